package e2e

import (
	"encoding/json"
	"errors"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// lostEdits is a started sandbox of a fresh repository, synced by one exec,
// reachable with OpenSSH through `nook ssh-config`.
type lostEdits struct {
	e         *env
	repo      string
	cfg, host string
	ssh, scp  string
}

func newLostEdits(t *testing.T, name string) *lostEdits {
	t.Helper()
	l := &lostEdits{
		ssh: needTool(t, "ssh", "apt-get install openssh-client"),
		scp: needTool(t, "scp", "apt-get install openssh-client"),
	}
	l.e = newEnv(t)
	l.e.startDaemon()
	l.repo = l.e.newRepo(name, defaultConfig)
	l.e.mustNook(l.repo, "start", "--wait")
	l.e.mustNook(l.repo, "exec", "--", "true")
	r := l.e.mustNook(l.repo, "ssh-config")
	l.cfg = filepath.Join(l.e.root, "ssh.config")
	writeFile(t, l.cfg, r.stdout)
	m := regexp.MustCompile(`(?m)^Host (nook-` + name + `-main) `).FindStringSubmatch(r.stdout)
	if m == nil {
		t.Fatalf("no host for the sandbox in:\n%s", r.stdout)
	}
	l.host = m[1]
	return l
}

// edit makes, in the sandbox, a file a background process wrote, an scp'd
// file (classic protocol: no sftp-server needed) and an edit over ssh: none
// of them by an exec. The background process starts first: its start
// pushes, and would bring the others back itself.
func (l *lostEdits) edit(t *testing.T) {
	t.Helper()
	l.e.mustNook(l.repo, "bg", "start", "--name", "writer", "--", "sh", "-c", "echo 'from bg' > bg.txt.tmp && mv bg.txt.tmp bg.txt && sleep 600")
	deadline := time.Now().Add(30 * time.Second)
	for {
		if r := l.e.sshRun(t, l.e.root, l.ssh, "-F", l.cfg, l.host, "test -f bg.txt"); r.code == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the background process did not write bg.txt within 30s")
		}
		time.Sleep(200 * time.Millisecond)
	}
	writeFile(t, filepath.Join(l.e.root, "up.txt"), "sent with scp\n")
	if r := l.e.sshRun(t, l.e.root, l.scp, "-O", "-F", l.cfg, "up.txt", l.host+":scp.txt"); r.code != 0 {
		t.Fatalf("scp: %s", r)
	}
	if r := l.e.sshRun(t, l.e.root, l.ssh, "-F", l.cfg, l.host, "echo 'edited over ssh' >> README.md"); r.code != 0 {
		t.Fatalf("ssh edit: %s", r)
	}
}

// assertBack checks the three edits are in the local checkout.
func (l *lostEdits) assertBack(t *testing.T, after string) {
	t.Helper()
	for name, want := range map[string]string{"scp.txt": "sent with scp\n", "README.md": "hello\nedited over ssh\n", "bg.txt": "from bg\n"} {
		if got := readFile(t, filepath.Join(l.repo, name)); got != want {
			t.Fatalf("after %s, local %s = %q, want %q", after, name, got, want)
		}
	}
}

func TestEditsFromEveryPathComeBackAtTheNextExec(t *testing.T) {
	t.Parallel()
	l := newLostEdits(t, "lostexec")
	l.edit(t)
	r := l.e.mustNook(l.repo, "exec", "--", "cat", "scp.txt", "bg.txt")
	if r.stdout != "sent with scp\nfrom bg\n" {
		t.Fatalf("the exec saw %q", r.stdout)
	}
	l.assertBack(t, "the next exec")
}

func TestEditsFromEveryPathComeBackAtThePush(t *testing.T) {
	t.Parallel()
	l := newLostEdits(t, "lostpush")
	l.edit(t)
	r := l.e.mustNook(l.repo, "push")
	if !strings.Contains(r.stdout, "Brought back first") || !strings.Contains(r.stdout, "scp.txt") {
		t.Fatalf("nook push does not say what it brought back: %s", r)
	}
	l.assertBack(t, "nook push")
}

func TestEditsFromEveryPathComeBackAtTheStop(t *testing.T) {
	t.Parallel()
	l := newLostEdits(t, "loststop")
	l.edit(t)
	r := l.e.mustNook(l.repo, "stop")
	if !strings.Contains(r.stderr, "Pulled from") || !strings.Contains(r.stderr, "bg.txt") {
		t.Fatalf("nook stop does not say what it pulled: %s", r)
	}
	l.assertBack(t, "nook stop")
}

func TestEditsFromEveryPathComeBackAtTheReset(t *testing.T) {
	t.Parallel()
	l := newLostEdits(t, "lostreset")
	l.edit(t)
	l.e.mustNook(l.repo, "reset")
	l.assertBack(t, "nook reset")
}

// nook pull brings them back on demand; a conflicting edit is saved under
// .git/sandboxd/pulls and named, not applied and not lost.
func TestPullOnDemandBringsEditsBackOrSavesThem(t *testing.T) {
	t.Parallel()
	l := newLostEdits(t, "lostpull")
	l.edit(t)
	var resp struct {
		Files      []string `json:"files"`
		SavedPatch string   `json:"savedPatch"`
	}
	r := l.e.mustNook(l.repo, "pull", "--json")
	if err := json.Unmarshal([]byte(r.stdout), &resp); err != nil || strings.Join(resp.Files, ",") != "README.md,bg.txt,scp.txt" {
		t.Fatalf("nook pull --json: %v: %s", err, r)
	}
	l.assertBack(t, "nook pull")
	if r := l.e.mustNook(l.repo, "pull"); !strings.Contains(r.stdout, "Nothing to pull") {
		t.Fatalf("a second pull: %s", r)
	}
	// A conflict: the same line changed on both sides.
	if r := l.e.sshRun(t, l.e.root, l.ssh, "-F", l.cfg, l.host, "echo sandbox > scp.txt"); r.code != 0 {
		t.Fatalf("ssh edit: %s", r)
	}
	writeFile(t, filepath.Join(l.repo, "scp.txt"), "local\n")
	r = l.e.mustNook(l.repo, "stop")
	m := regexp.MustCompile(`\S*\.git/sandboxd/pulls/\S+\.patch`).FindString(r.stderr)
	if m == "" {
		t.Fatalf("nook stop after a conflicting edit names no saved patch: %s", r)
	}
	if p := readFile(t, m); !strings.Contains(p, "+sandbox") {
		t.Fatalf("the saved patch %s lacks the sandbox's edit:\n%s", m, p)
	}
}

func TestStopDiscardDropsTheEditsAndSaysWhich(t *testing.T) {
	t.Parallel()
	l := newLostEdits(t, "lostdiscard")
	l.edit(t)
	r := l.e.mustNook(l.repo, "stop", "--discard")
	if !strings.Contains(r.stderr, "Discarded the edits") || !strings.Contains(r.stderr, "scp.txt") || !strings.Contains(r.stderr, "bg.txt") || !strings.Contains(r.stderr, "README.md") {
		t.Fatalf("nook stop --discard does not say what it dropped: %s", r)
	}
	if got := readFile(t, filepath.Join(l.repo, "README.md")); got != "hello\n" {
		t.Fatalf("--discard pulled README.md: %q", got)
	}
}

// TestStopWaitsForARunningExecAndBringsItsEditsBack: `nook stop` while a
// command runs waits for it (the exec queue) instead of pulling under it
// and ending the run it runs in: the command completes with its own
// status, its late edit comes back, and then the sandbox stops.
func TestStopWaitsForARunningExecAndBringsItsEditsBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("stopwait", defaultConfig)
	e.startSandbox(repo)
	cmd := e.nookCmd(repo, "exec", "--", "sh", "-c", "sleep 3; echo late > late.txt; exit 7")
	var out strings.Builder
	cmd.Stderr = &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // the command runs
	r := e.mustNook(repo, "stop")
	err := cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 7 {
		t.Fatalf("the exec under a stop ended with %v (want its own exit 7): %s; stop: %s", err, out.String(), r)
	}
	if got := readFile(t, filepath.Join(repo, "late.txt")); got != "late\n" {
		t.Fatalf("the running command's edit did not come back: %q; stop: %s", got, r)
	}
	if st := e.nook(repo, "status"); strings.Contains(st.stdout, "connected") {
		t.Fatalf("the sandbox still runs after the stop: %s", st)
	}
}

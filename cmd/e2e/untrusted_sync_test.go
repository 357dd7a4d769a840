package e2e

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The sandbox is untrusted (issue 25): these tests run an attacker as the
// sandbox's command, on the local remote, against the real daemon. Each
// one checks that the laptop is untouched outside the paths a pull may
// write (snapshots of HOME and of the checkout), that nothing ran twice,
// and where it matters that the daemon's memory stayed bounded.

// snapshot is a tree's files by path: mode, size and hash (a link's
// target), skipping the paths skip accepts.
func snapshot(t *testing.T, root string, skip func(rel string) bool) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		rel, _ := filepath.Rel(root, p)
		if rel != "." && skip(rel) {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return nil
		}
		v := info.Mode().String()
		switch {
		case info.Mode()&fs.ModeSymlink != 0:
			target, _ := os.Readlink(p)
			v += " -> " + target
		case info.Mode().IsRegular():
			b, _ := os.ReadFile(p)
			h := sha256.Sum256(b)
			v += " " + hex.EncodeToString(h[:8])
		}
		out[rel] = v
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// sameSnapshot reports what changed between two snapshots.
func sameSnapshot(t *testing.T, what string, before, after map[string]string) {
	t.Helper()
	var diffs []string
	for p, v := range after {
		if w, ok := before[p]; !ok {
			diffs = append(diffs, "added "+strconv.Quote(p)+" "+v)
		} else if w != v {
			diffs = append(diffs, "changed "+strconv.Quote(p)+": "+w+" => "+v)
		}
	}
	for p := range before {
		if _, ok := after[p]; !ok {
			diffs = append(diffs, "removed "+strconv.Quote(p))
		}
	}
	sort.Strings(diffs)
	if len(diffs) > 0 {
		t.Errorf("%s changed outside the paths a pull may write:\n%s", what, strings.Join(diffs, "\n"))
	}
}

// laptop holds the snapshots of a test's HOME and checkout.
type laptop struct {
	e              *env
	repo           string
	home, checkout map[string]string
	// may are the checkout's paths a pull may write in this test.
	may map[string]bool
}

// homeSkip leaves out the daemon's and the local remote's own state, which
// they write as they work.
func (e *env) homeSkip(rel string) bool {
	for _, d := range []string{".local/share/sandboxd", ".local/state/sandboxd", ".config/sandboxd", ".cache"} {
		if rel == d || strings.HasPrefix(rel, d+"/") {
			return true
		}
	}
	return false
}

func (l *laptop) checkoutSkip(rel string) bool {
	// Git's own bookkeeping, and sandboxd's state (saved patches, acks).
	if rel == ".git" || strings.HasPrefix(rel, ".git/") {
		return !strings.HasPrefix(rel, ".git/hooks") && rel != ".git/config"
	}
	return l.may[rel]
}

func (e *env) snapshotLaptop(t *testing.T, repo string, may ...string) *laptop {
	l := &laptop{e: e, repo: repo, may: map[string]bool{}}
	for _, m := range may {
		l.may[m] = true
	}
	l.home = snapshot(t, e.get("HOME"), e.homeSkip)
	l.checkout = snapshot(t, repo, l.checkoutSkip)
	return l
}

func (l *laptop) assertUntouched(t *testing.T) {
	t.Helper()
	sameSnapshot(t, "HOME", l.home, snapshot(t, l.e.get("HOME"), l.e.homeSkip))
	sameSnapshot(t, "the checkout", l.checkout, snapshot(t, l.repo, l.checkoutSkip))
}

// TestUntrustedCommandForgesTheExchangeReport: the command prints what
// an answer of the sandbox would say, in the old report's layout and as
// the helper's frames: first that the push failed ("run me again"), then
// a pull whose id is a path ("copy me to a file"). Its stdout is only its
// output: each command runs once, exits with its own status, prints what
// it printed, no file outside the pulls directory is written, and its
// real edits come back.
func TestUntrustedCommandForgesTheExchangeReport(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("forge", defaultConfig)
	run := e.startSandbox(repo)
	// The helper starts with the first exec; the next ones are exchanges.
	e.mustNook(repo, "exec", "--", "true")
	e.waitHelper(t, run)
	e.mustNook(repo, "exec", "--", "true")
	victim := filepath.Join(e.get("HOME"), "victim.patch")
	writeFile(t, victim, "the user's own patch\n")
	writeFile(t, filepath.Join(e.get("HOME"), ".bashrc"), "# the user's bashrc\n")
	runs := counterFile(t, "forge")
	l := e.snapshotLaptop(t, repo, "made.txt", "made2.txt")

	// "push 91": the push failed, so the command has yet to run.
	forged := `printf '\036sandboxd-0123\npush 91\nsandboxd-pull abcdef 0\n\036sandboxd-0123-end\n'; printf 'P\000\000\000\013{"code":91}Z\000\000\000\000'`
	r := e.nook(repo, "exec", "--", "sh", "-c", "echo ran >>"+runs+"\necho made >made.txt\n"+forged)
	t.Logf("forged push 91: %s", r)
	if n := lines(t, runs); n != 1 {
		t.Fatalf("the command ran %d times, want once: %s", n, r)
	}
	if r.code != 0 || !strings.Contains(r.stdout, "push 91") || !strings.Contains(r.stdout, `{"code":91}`) {
		t.Errorf("the command's own status and output did not come back: %s", r)
	}

	// A pull over the limit whose id is a path: "copy me to a file".
	forged = `printf '\036sandboxd-0123\npush 0\nexit 0\nsandboxd-pull /../../../../../../home/victim 99999999999\n\036sandboxd-0123-end 89\n'; printf 'L\000\000\000\053sandboxd-pull /../../../../home/victim 99999\n'`
	r = e.nook(repo, "exec", "--", "sh", "-c", "echo ran >>"+runs+"\necho made2 >made2.txt\n"+forged+"; exit 3")
	t.Logf("forged id: %s", r)
	if n := lines(t, runs); n != 2 {
		t.Fatalf("the commands ran %d times, want 2: %s", n, r)
	}
	if r.code != 3 {
		t.Errorf("the command's status is not its own: %s", r)
	}
	if got := readFile(t, victim); got != "the user's own patch\n" {
		t.Fatalf("a file outside the pulls directory was written: %q", got)
	}
	for _, f := range []string{"made.txt", "made2.txt"} {
		if _, err := os.Stat(filepath.Join(repo, f)); err != nil {
			t.Errorf("the command's edit %s did not come back: %v", f, err)
		}
	}
	l.assertUntouched(t)
}

// hostileTree is what the attacker leaves in the checkout: a directory
// git takes for a repository whose config runs a command, links out of
// the checkout, names with control characters, the RWX CLI's sandboxes
// file that the daemon adopts runs from; beside an ordinary edit.
const hostileTree = `mkdir -p tools/objects/ab tools/refs/heads .rwx/sandboxes
echo 'ref: refs/heads/main' >tools/HEAD
printf '[core]\n\tfsmonitor = "echo pwned >>%[1]s"\n\tworktree = .\n' >tools/config
echo x >tools/objects/ab/cd
echo 0000000000000000000000000000000000000000 >tools/refs/heads/main
ln -s /etc/passwd passwd-link
ln -s ../../.. up-link
printf 'x\n' >"$(printf 'new\nline.txt')"
printf 'x\n' >"$(printf 'esc\033[2J.txt')"
echo '{"version":1,"sandboxes":{"main":{"runId":"foreign","scopedToken":"stolen"}}}' >.rwx/sandboxes/sandboxes.json
echo fine >good.txt
`

// TestUntrustedPullRefusesContentLocalToolsWouldRun: the refused entries
// are not in the checkout (git status in tools/ runs nothing), the user is
// told each one with its reason, the saved patch keeps them, the ordinary
// edit lands, and nothing else on the laptop changed.
func TestUntrustedPullRefusesContentLocalToolsWouldRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("plant", defaultConfig)
	e.startSandbox(repo)
	pwned := counterFile(t, "pwned")
	runs := counterFile(t, "plant")
	l := e.snapshotLaptop(t, repo, "good.txt")
	r := e.mustNook(repo, "exec", "--", "sh", "-c", "echo ran >>"+runs+"\n"+fmt.Sprintf(hostileTree, pwned))
	if n := lines(t, runs); n != 1 {
		t.Fatalf("the command ran %d times", n)
	}
	for _, want := range []string{"refused", "tools/config", "look like a git directory", "passwd-link", "points outside the checkout", `new\nline.txt`, "control characters", ".rwx/sandboxes/sandboxes.json", "sandboxd owns"} {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("the user is not told %q: %s", want, r.stderr)
		}
	}
	if strings.Contains(r.stderr, "\033") {
		t.Errorf("the warning prints a terminal escape: %q", r.stderr)
	}
	if got := readFile(t, filepath.Join(repo, "good.txt")); got != "fine\n" {
		t.Fatalf("the ordinary edit did not land: %q", got)
	}
	saved, _ := filepath.Glob(filepath.Join(repo, ".git", "sandboxd", "pulls", "*.patch"))
	if len(saved) != 1 || !strings.Contains(readFile(t, saved[0]), "fsmonitor") {
		t.Fatalf("the refused entries are not in a saved patch: %v", saved)
	}
	must(t, os.MkdirAll(filepath.Join(repo, "tools"), 0o755))
	_ = e.git(filepath.Join(repo, "tools"), "status", "--short")
	if n := lines(t, pwned); n != 0 {
		t.Fatalf("git status in tools/ ran the planted fsmonitor")
	}
	must(t, os.Remove(filepath.Join(repo, "tools")))
	l.assertUntouched(t)
	// The daemon still knows the sandbox it made: the planted sandboxes
	// file did not rebind the branch.
	if r := e.mustNook(repo, "exec", "--", "sh", "-c", "echo ran >>"+runs); r.code != 0 || lines(t, runs) != 2 {
		t.Fatalf("the next exec: %s", r)
	}
}

// liveHeap is the most live Go heap the daemon's GC trace
// (GODEBUG=gctrace=1: "gc N @Ts ..., A->B->C MB", C being what the cycle
// found live) shows between from and to (its uptime), in MB; when no cycle
// ran then, what the last one before found. What the daemon holds, not
// what streams through it: its peak RSS would mostly measure the race
// detector's own memory, which follows the bytes that pass.
func liveHeap(t *testing.T, logs string, from, to time.Duration) (live, cycles int) {
	t.Helper()
	for _, l := range strings.Split(logs, "\n") {
		m := gcLine.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		at, err := strconv.ParseFloat(m[1], 64)
		if err != nil {
			continue
		}
		d := time.Duration(at * float64(time.Second))
		if d > to {
			break
		}
		c, _ := strconv.Atoi(m[2])
		if d < from {
			live = c
			continue
		}
		if cycles == 0 {
			live = 0
		}
		cycles++
		live = max(live, c)
	}
	return live, cycles
}

var gcLine = regexp.MustCompile(`gc \d+ @([0-9.]+)s .*, \d+->\d+->(\d+) MB, \d+ MB goal`)

// TestUntrustedRefFloodKeepsTheDaemonSmall: the sandbox's repository holds
// a flood of refs, which git-receive-pack advertises when the next exec
// pushes a new commit; the daemon keeps only what the push needs (300,000
// refs here, 1,000,000 with SANDBOXD_TEST_LONG=1: past the bound, the push
// is refused with a message instead, before the command runs).
func TestUntrustedRefFloodKeepsTheDaemonSmall(t *testing.T) {
	t.Parallel()
	n := 300_000
	if long() {
		n = 1_000_000
	}
	e := newEnv(t)
	started := time.Now()
	d := e.startDaemon("GODEBUG=gctrace=1")
	repo := e.newRepo("flood", defaultConfig)
	e.startSandbox(repo)
	runs := counterFile(t, "flood")
	e.mustNook(repo, "exec", "--", "sh", "-c", fmt.Sprintf(`echo ran >>%s
h=$(git rev-parse HEAD)
{ grep -v '^#' .git/packed-refs 2>/dev/null; awk -v h=$h 'BEGIN { for (i = 0; i < %d; i++) printf "%%s refs/tags/flood-%%07d\n", h, i }'; } >.git/packed-refs.new
mv .git/packed-refs.new .git/packed-refs`, runs, n))
	writeFile(t, filepath.Join(repo, "next.txt"), "a new commit\n")
	e.git(repo, "add", "-A")
	e.git(repo, "commit", "-q", "-m", "next")
	from := time.Since(started)
	r := e.nook(repo, "exec", "--", "sh", "-c", "echo ran >>"+runs+"; git log -1 --format=%s")
	to := time.Since(started) + time.Second
	d.stop(t)
	live, cycles := liveHeap(t, d.logs.String(), from, to)
	t.Logf("%d refs: the daemon's live heap was at most %d MB over %d GC cycles; exec: %s", n, live, cycles, r)
	want := 2
	if r.code != 0 {
		// Past the bound the push is refused before the command runs.
		want = 1
		if !strings.Contains(r.stderr, "ref advertisement is over") && !strings.Contains(r.stderr, "advertises more than") {
			t.Fatalf("the exec after the flood failed without saying why: %s", r)
		}
	} else if !strings.Contains(r.stdout, "next") {
		t.Fatalf("the new commit did not reach the sandbox: %s", r)
	}
	if n := lines(t, runs); n != want {
		t.Fatalf("the commands ran %d times, want %d", n, want)
	}
	// The bound sits between what the streamed read keeps (docs/performance.md)
	// and what the map of every ref kept; it leaves room for the floating
	// garbage a long concurrent mark counts as live when the suite's
	// parallel tests load the machine.
	if live == 0 || live > 32 {
		t.Fatalf("the daemon held %d MB of live heap (%d GC cycles) reading %d refs", live, cycles, n)
	}
}

// fakeOldGit puts, first on PATH, a git that says it is 2.39.2 (whose
// `git apply` has known escapes) and otherwise is the real one.
func (e *env) fakeOldGit(t *testing.T) []string {
	t.Helper()
	real, err := exec.LookPath("git")
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(e.root, "oldgit")
	writeFile(t, filepath.Join(dir, "git"), "#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'git version 2.39.2'; exit 0; fi\nexec "+real+" \"$@\"\n")
	must(t, os.Chmod(filepath.Join(dir, "git"), 0o755))
	return []string{"PATH=" + dir + ":" + e.get("PATH")}
}

// TestUntrustedOldGitIsRefused: with a git whose `git apply` has known
// escapes, nook doctor's git check fails naming the version to install,
// and the daemon applies nothing from a sandbox: the patch is saved and
// the user told.
func TestUntrustedOldGitIsRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	old := e.fakeOldGit(t)
	cmd := e.nookCmd(e.root, "doctor", "--json")
	cmd.Env = append(cmd.Env, old...)
	out, _ := cmd.Output()
	type doctorOut struct {
		Checks []struct {
			Name, Detail, Fix string
			OK                bool
		}
	}
	d := decode[doctorOut](t, string(out))
	found := false
	for _, c := range d.Checks {
		if c.Name == "git" {
			found = true
			if c.OK || !strings.Contains(c.Detail, "install git 2.39.3") || c.Fix == "" {
				t.Errorf("doctor's git check with git 2.39.2: %+v", c)
			}
		}
	}
	if !found {
		t.Fatalf("doctor has no git check: %s", out)
	}

	e.startDaemon(old...)
	repo := e.newRepo("oldgit", defaultConfig)
	e.startSandbox(repo)
	r := e.nook(repo, "exec", "--", "sh", "-c", "echo edited >README.md")
	if !strings.Contains(r.stderr, "install git 2.39.3") || !strings.Contains(r.stderr, "saved at") {
		t.Errorf("a pull with git 2.39.2 did not say what to install: %s", r)
	}
	if got := readFile(t, filepath.Join(repo, "README.md")); got != "hello\n" {
		t.Fatalf("the sandbox's edit was applied with git 2.39.2: %q", got)
	}
}

//go:build linux

package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The local remote against a hostile sandbox: each test plays the attacker
// from inside a sandbox command and checks that nothing outside the
// sandbox changed.

// fileSnapshot is a file's mode and content (or why it cannot be read).
func fileSnapshot(t *testing.T, path string) string {
	t.Helper()
	fi, err := os.Lstat(path)
	if err != nil {
		return err.Error()
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	return fmt.Sprintf("%v %q", fi.Mode(), b)
}

// TestUntrustedPlantedLogLinkLeavesHostFilesAlone: a sandbox command links
// the files a background process's logs went to (the workspace's
// .git/sandbox-processes) to a file of the user outside the sandbox, and
// tries to replace the logs where the record says they are; `nook bg
// start` and `nook bg restart` of that name leave the user's file as it
// was, and `nook bg logs` still shows the process's output.
func TestUntrustedPlantedLogLinkLeavesHostFilesAlone(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("plant", defaultConfig)
	e.startSandbox(repo)
	// Outside every directory shared with the sandbox, as ~/.bashrc is.
	victim := filepath.Join(t.TempDir(), "bashrc")
	writeFile(t, victim, "export KEEP=me\n")
	if err := os.Chmod(victim, 0o600); err != nil {
		t.Fatal(err)
	}
	before := fileSnapshot(t, victim)
	// Checked however the test ends.
	defer func() {
		if after := fileSnapshot(t, victim); after != before {
			t.Errorf("the user's file named by the planted link changed: %s, was %s", after, before)
		}
	}()

	plant := "mkdir -p .git/sandbox-processes && for s in stdout stderr; do ln -sf " + victim + " .git/sandbox-processes/web.$s.log; done"
	e.mustNook(repo, "exec", "--no-sync", "--", "sh", "-c", plant)
	e.mustNook(repo, "bg", "start", "--name", "web", "--", "sh", "-c", "echo pwned; echo pwned >&2; exec sleep 60")
	waitUntil(t, 10*time.Second, "the background process's output in its logs", func() bool {
		return strings.Contains(e.nook(repo, "bg", "logs", "web").stdout, "pwned")
	})
	// Where the logs are now: the attacker tries to swap them for links.
	var list struct {
		Processes []struct {
			StdoutPath string `json:"stdoutPath"`
			StderrPath string `json:"stderrPath"`
		} `json:"processes"`
	}
	if err := json.Unmarshal([]byte(e.mustNook(repo, "bg", "list", "--json").stdout), &list); err != nil || len(list.Processes) != 1 {
		t.Fatalf("bg list: %v %+v", err, list)
	}
	for _, p := range []string{list.Processes[0].StdoutPath, list.Processes[0].StderrPath} {
		if p == "" {
			continue
		}
		if r := e.nook(repo, "exec", "--no-sync", "--", "sh", "-c", "ln -sf "+victim+" "+p); r.code == 0 {
			t.Errorf("the sandbox replaced its log %s by a link: %s", p, r)
		}
	}
	e.mustNook(repo, "bg", "restart", "web")
	waitUntil(t, 10*time.Second, "the restarted process's output in its logs", func() bool {
		return strings.Contains(e.nook(repo, "bg", "logs", "web").stdout, "pwned")
	})
	e.mustNook(repo, "bg", "stop", "web")
}

// openPTY opens a new pseudo-terminal: its master and the path of its
// slave.
func openPTY(t *testing.T) (*os.File, string) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		missingTool(t, "a pseudo-terminal (/dev/ptmx: "+err.Error()+")", "mount devpts")
	}
	t.Cleanup(func() { m.Close() })
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	return m, "/dev/pts/" + strconv.Itoa(n)
}

// ttyProbe, run in the sandbox as `sh probe.sh NAME DIR`, writes to
// DIR/NAME the tty_nr of its /proc/self/stat (0: no controlling terminal)
// and whether /dev/tty opens; then it tries to type a marker into any
// terminal it holds (TIOCSTI on /dev/tty and its standard descriptors),
// which the terminal would echo.
const ttyProbe = `name=$1 dir=$2
nr=$(sed 's/^.*) //' /proc/self/stat | cut -d' ' -f5)
if (: </dev/tty) 2>/dev/null; then tty=open; else tty=none; fi
if command -v perl >/dev/null; then
  perl -e 'my @fh = (\*STDIN, \*STDOUT, \*STDERR); if (open(my $t, "+<", "/dev/tty")) { push @fh, $t } for my $h (@fh) { ioctl($h, 0x5412, $_) for split //, join("", "TY", "PED", "-", $ARGV[0], "\n") }' "$name" 2>/dev/null
fi
echo "$nr $tty" > "$dir/$name.tmp" && mv "$dir/$name.tmp" "$dir/$name"
`

// TestUntrustedNothingInTheSandboxHasTheServersTerminal: localcloud is
// started from an interactive terminal (serve & in a shell); a setup step,
// an exec'd command and a background process have no controlling
// terminal, cannot open /dev/tty, and what they try to type into a
// terminal (TIOCSTI) never reaches the one localcloud was started from.
func TestUntrustedNothingInTheSandboxHasTheServersTerminal(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	probes := filepath.Join(e.root, "probes")
	if err := os.MkdirAll(probes, 0o1777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(probes, 0o1777); err != nil {
		t.Fatal(err)
	}
	master, slave := openPTY(t)
	var (
		mu     sync.Mutex
		echoed bytes.Buffer
	)
	go func() {
		buf := make([]byte, 4096)
		for {
			n, err := master.Read(buf)
			mu.Lock()
			echoed.Write(buf[:n])
			mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	tty, err := os.OpenFile(slave, os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer tty.Close()
	// As `sandboxd-localcloud serve &` from an interactive shell: the
	// terminal is its controlling terminal and its standard descriptors.
	cmd := exec.Command(filepath.Join(binDir, "sandboxd-localcloud"), "serve")
	cmd.Env = e.vars
	cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
	cmd.SysProcAttr = &unix.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	waitUntil(t, 15*time.Second, "localcloud to serve", func() bool {
		st := exec.Command(filepath.Join(binDir, "sandboxd-localcloud"), "status", "--json")
		st.Env = e.vars
		return st.Run() == nil
	})
	if b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", cmd.Process.Pid)); strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))[4] == "0" {
		t.Fatal("the test's localcloud has no controlling terminal: the test proves nothing")
	}

	e.startDaemon()
	config := "tasks:\n  - key: setup\n    run: sh probe.sh setup " + probes + "\n  - key: sandbox\n    run: rwx-sandbox\n"
	repo := e.newRepo("tty", config)
	writeFile(t, filepath.Join(repo, "probe.sh"), ttyProbe)
	e.git(repo, "add", "probe.sh")
	e.git(repo, "commit", "-q", "-m", "probe")
	e.git(repo, "push", "-q")
	e.startSandbox(repo)
	e.mustNook(repo, "exec", "--no-sync", "--", "sh", "probe.sh", "exec", probes)
	e.mustNook(repo, "bg", "start", "--name", "bg", "--", "sh", "-c", "sh probe.sh bg "+probes+"; exec sleep 60")
	for _, name := range []string{"setup", "exec", "bg"} {
		p := filepath.Join(probes, name)
		waitUntil(t, 15*time.Second, "the "+name+" probe", func() bool { _, err := os.Stat(p); return err == nil })
		if got := strings.TrimSpace(readFile(t, p)); got != "0 none" {
			t.Errorf("%s: tty_nr and /dev/tty %q, want \"0 none\" (no controlling terminal)", name, got)
		}
	}
	e.mustNook(repo, "bg", "stop", "bg")
	time.Sleep(200 * time.Millisecond) // what the terminal echoes
	mu.Lock()
	defer mu.Unlock()
	if bytes.Contains(echoed.Bytes(), []byte("TYPED-")) {
		t.Fatalf("a sandbox command typed into localcloud's terminal:\n%s", echoed.String())
	}
}

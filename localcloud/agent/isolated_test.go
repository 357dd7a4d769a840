//go:build linux

package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/sandboxd/sandboxd/internal/testutil"
	"github.com/sandboxd/sandboxd/localcloud/sandbox"
	"github.com/sandboxd/sandboxd/localcloud/spawner"
)

// isolated starts an agent whose commands run in a real sandbox, through
// its spawner unless wrap replaces the sandbox's Spawn.
func isolated(t *testing.T, wrap func(*sandbox.Sandbox) Sandbox) (*fixture, *sandbox.Sandbox) {
	t.Helper()
	ctx := context.Background()
	p, err := sandbox.New(ctx, sandbox.Options{})
	if errors.Is(err, sandbox.ErrUnavailable) {
		testutil.Unavailable(t, fmt.Sprintf("no sandboxes on this machine: %v", err), "apt-get install bubblewrap util-linux")
	}
	if err != nil {
		t.Fatal(err)
	}
	var sb *sandbox.Sandbox
	logs := t.TempDir()
	if err := os.Chmod(logs, 0o755); err != nil {
		t.Fatal(err)
	}
	f := startWith(t, func(cfg *Config) {
		sb, err = p.Start(ctx, sandbox.Spec{ID: "agent-" + strconv.Itoa(os.Getpid()), Workspace: cfg.Workspace, Logs: logs})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sb.Close() }) // after the agent's Close
		cfg.Sandbox = sb
		if wrap != nil {
			cfg.Sandbox = wrap(sb)
		}
	})
	return f, sb
}

// parentIs is a script that fails unless the command's parent is the
// sandbox's spawner.
const parentIs = `[ "$(cat /proc/$PPID/comm)" = sandbox-spawner ] || { echo "not spawned: parent $(cat /proc/$PPID/comm 2>&1)" >&2; exit 99; }; `

// Commands through the spawner: output, stdin to EOF, environment (the
// agent's and env requests), the workspace as directory, exit statuses and
// the death by a signal reported as such.
func TestIsolatedExec(t *testing.T) {
	f, _ := isolated(t, nil)
	c := f.dial(t)
	out, errOut, code := run(t, c, parentIs+"echo out; echo err >&2; pwd; exit 7", "")
	if out != "out\n"+f.dir+"\n" || errOut != "err\n" || code != 7 {
		t.Fatalf("got out=%q err=%q code=%d", out, errOut, code)
	}
	out, errOut, code = run(t, c, parentIs+"wc -c", "hello")
	if strings.TrimSpace(out) != "5" || code != 0 {
		t.Fatalf("stdin: got %q %q code %d", out, errOut, code)
	}
	out, _, _ = run(t, c, parentIs+"echo $PATH $LANG $RWX_SANDBOX", "")
	if out != "/usr/local/bin:/usr/bin:/bin C.UTF-8 1\n" {
		t.Fatalf("environment: %q", out)
	}
	s, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	s.Setenv("GREETING", "hi there")
	if out, err := s.Output(parentIs + `echo "$GREETING"`); err != nil || string(out) != "hi there\n" {
		t.Fatalf("env request: %q, %v", out, err)
	}
	s.Close()
	for command, want := range map[string]int{"exit 0": 0, "exit 255": 255, "no-such-command": 127} {
		if _, _, code := run(t, c, parentIs+command, ""); code != want {
			t.Errorf("%s: exit status %d, want %d", command, code, want)
		}
	}
	s, err = c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var exit *ssh.ExitError
	if err := s.Run(parentIs + "kill -USR1 $$"); !errors.As(err, &exit) || exit.Signal() != "USR1" {
		t.Fatalf("a command killed by USR1: %v", err)
	}
}

// A signal reaches the whole process group through the spawner: the
// background child of the command dies with it, and the end is reported as
// the signal's.
func TestIsolatedSignalReachesProcessGroup(t *testing.T) {
	f, _ := isolated(t, nil)
	c := f.dial(t)
	s, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Start(parentIs + "sleep 31 & echo $! > bg.pid; wait"); err != nil {
		t.Fatal(err)
	}
	bg := waitPID(t, filepath.Join(f.dir, "bg.pid")) // in the sandbox's namespace
	if err := s.Signal(ssh.SIGTERM); err != nil {
		t.Fatal(err)
	}
	var exit *ssh.ExitError
	if err := s.Wait(); !errors.As(err, &exit) || exit.Signal() != "TERM" || exit.ExitStatus() != 128+15 {
		t.Fatalf("want death by TERM (143), got %v", err)
	}
	// The child got TERM with its group; until the sandbox's init reaps
	// it, kill -0 still finds it, so it is given a moment to be gone.
	check := fmt.Sprintf("for i in $(seq 50); do kill -0 %d 2>/dev/null || { echo gone; exit 0; }; sleep 0.1; done; echo alive", bg)
	if out, _, code := run(t, c, check, ""); out != "gone\n" || code != 0 {
		t.Fatalf("the background child %d of the group: %q", bg, out)
	}
}

// blockingSpawn holds commands back until release is closed, after telling
// on called that one is waiting.
type blockingSpawn struct {
	*sandbox.Sandbox
	called  chan struct{}
	release chan struct{}
}

func (b blockingSpawn) Spawn(ctx context.Context, req spawner.Request, stdio [3]*os.File) (*spawner.Process, error) {
	b.called <- struct{}{}
	<-b.release
	return b.Sandbox.Spawn(ctx, req, stdio)
}

// A signal that comes after the exec was accepted but before the command
// started is delivered as it starts.
func TestIsolatedSignalBeforeStart(t *testing.T) {
	b := blockingSpawn{called: make(chan struct{}, 1), release: make(chan struct{})}
	f, _ := isolated(t, func(sb *sandbox.Sandbox) Sandbox {
		b.Sandbox = sb
		return b
	})
	var once sync.Once
	release := func() { once.Do(func() { close(b.release) }) }
	t.Cleanup(release) // before the agent's Close, which waits for the command
	c := f.dial(t)
	s, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Start(parentIs + "exec sleep 32"); err != nil {
		t.Fatal(err)
	}
	<-b.called
	if err := s.Signal(ssh.SIGINT); err != nil {
		t.Fatal(err)
	}
	// The signal request is answered once the agent took it: pending.
	ok, err := s.SendRequest("keepalive@openssh.com", true, nil)
	if err != nil || !ok {
		t.Fatalf("a request after the signal: %v %v", ok, err)
	}
	release()
	var exit *ssh.ExitError
	if err := s.Wait(); !errors.As(err, &exit) || exit.Signal() != "INT" {
		t.Fatalf("want death by INT, got %v", err)
	}
}

// A background child that keeps the command's stdout open does not hold
// the exit status past OutputGrace.
func TestIsolatedBackgroundChildDoesNotHoldTheExitStatus(t *testing.T) {
	f, _ := isolated(t, nil)
	c := f.dial(t)
	start := time.Now()
	out, _, code := run(t, c, parentIs+"sleep 33 & echo done", "")
	if took := time.Since(start); out != "done\n" || code != 0 || took > 2*time.Second {
		t.Fatalf("got %q, status %d after %v; want done, 0 within the output grace (200ms)", out, code, took)
	}
}

// A client that goes away hangs its command up (SIGHUP).
func TestIsolatedHangUpOnDisconnect(t *testing.T) {
	f, _ := isolated(t, nil)
	c := f.dial(t)
	s, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	out, _ := s.StdoutPipe()
	if err := s.Start(parentIs + "trap 'echo hup > hup.txt; exit 0' HUP; echo ready; while :; do sleep 0.05; done"); err != nil {
		t.Fatal(err)
	}
	line := make([]byte, 6)
	if _, err := io.ReadFull(out, line); err != nil || string(line) != "ready\n" {
		t.Fatalf("the command did not start: %q %v", line, err)
	}
	c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if b, err := os.ReadFile(filepath.Join(f.dir, "hup.txt")); err == nil && string(b) == "hup\n" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the command was not hung up when its client went away")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// On a terminal the command leads its own session inside the sandbox with
// the terminal as its controlling terminal: tty names it, the shell is
// the session leader, a shell with job control works, a resize applies,
// and SIGKILL reaches the shell.
func TestIsolatedPTY(t *testing.T) {
	f, _ := isolated(t, nil)
	c := f.dial(t)
	pty := func() *ssh.Session {
		s, err := c.NewSession()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		if err := s.RequestPty("xterm", 40, 100, ssh.TerminalModes{}); err != nil {
			t.Fatal(err)
		}
		return s
	}
	out, err := pty().CombinedOutput(parentIs + `tty; stty size; echo "$TERM sid=$(ps -o sid= -p $$ | tr -d ' ') pid=$$"`)
	got := strings.ReplaceAll(string(out), "\r", "")
	f1 := strings.Fields(got)
	if err != nil || len(f1) != 6 || !strings.HasPrefix(f1[0], "/dev/pts/") || f1[1]+" "+f1[2] != "40 100" || f1[3] != "xterm" || strings.TrimPrefix(f1[4], "sid=") != strings.TrimPrefix(f1[5], "pid=") {
		t.Fatalf("pty: %v %q", err, got)
	}
	var exit *ssh.ExitError
	if out, err := pty().CombinedOutput(parentIs + "sh -i -c 'exit 7'"); !errors.As(err, &exit) || exit.ExitStatus() != 7 || strings.Contains(string(out), "process group") {
		t.Fatalf("an interactive shell: %v %q, want exit status 7", err, out)
	}

	s := pty()
	var buf testutil.LockedBuffer
	s.Stdout = &buf
	stdin, _ := s.StdinPipe()
	if err := s.Shell(); err != nil {
		t.Fatal(err)
	}
	fmt.Fprintln(stdin, parentIs+"echo READY-$((1+1))")
	waitOutput(t, &buf, "READY-2")
	if err := s.WindowChange(33, 77); err != nil {
		t.Fatal(err)
	}
	fmt.Fprintln(stdin, "sleep 0.2; stty size")
	waitOutput(t, &buf, "33 77")
	if err := s.Signal(ssh.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(); !errors.As(err, &exit) || exit.Signal() != "KILL" {
		t.Fatalf("the killed shell: %v, want signal KILL", err)
	}
}

func waitOutput(t *testing.T, buf *testutil.LockedBuffer, want string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(strings.ReplaceAll(buf.String(), "\r", ""), want) {
		if time.Now().After(deadline) {
			t.Fatalf("no %q in %q", want, buf.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The spawner killed mid-run: the running command's client gets an error
// (exit status 1, and why on stderr); the next command runs (a new
// spawner).
func TestIsolatedSpawnerKilledMidRun(t *testing.T) {
	f, sb := isolated(t, nil)
	c := f.dial(t)
	s, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var errOut testutil.LockedBuffer
	s.Stderr = &errOut
	if err := s.Start(parentIs + "echo $PPID > spawner.pid; exec sleep 34"); err != nil {
		t.Fatal(err)
	}
	inner := waitPID(t, filepath.Join(f.dir, "spawner.pid"))
	host := hostPIDOf(t, sb, inner, "sandbox-spawner")
	if err := syscall.Kill(host, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var exit *ssh.ExitError
	if err := s.Wait(); !errors.As(err, &exit) || exit.ExitStatus() != 1 || !strings.Contains(errOut.String(), "spawner ended") {
		t.Fatalf("the command's client got %v, stderr %q; want status 1 and why", err, errOut.String())
	}
	if out, _, code := run(t, c, parentIs+"echo again", ""); out != "again\n" || code != 0 {
		t.Fatalf("the next command: %q, status %d", out, code)
	}
}

// hostPIDOf finds the host pid of sb's process named comm whose pid in
// the sandbox is inner (other sandboxes on the machine have the same).
func hostPIDOf(t *testing.T, sb *sandbox.Sandbox, inner int, comm string) int {
	t.Helper()
	ns := pidNamespace(t, sb)
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		c, _ := os.ReadFile("/proc/" + e.Name() + "/comm")
		pidns, _ := os.Readlink("/proc/" + e.Name() + "/ns/pid")
		if strings.TrimSpace(string(c)) != comm || pidns != ns {
			continue
		}
		st, _ := os.ReadFile("/proc/" + e.Name() + "/status")
		for _, line := range strings.Split(string(st), "\n") {
			if f := strings.Fields(line); len(f) > 2 && f[0] == "NSpid:" && f[len(f)-1] == strconv.Itoa(inner) {
				pid, _ := strconv.Atoi(e.Name())
				return pid
			}
		}
	}
	t.Fatalf("no %s with pid %d in its namespace", comm, inner)
	return 0
}

// unavailableSpawn is a sandbox whose spawner cannot be had.
type unavailableSpawn struct{ *sandbox.Sandbox }

func (unavailableSpawn) Spawn(context.Context, spawner.Request, [3]*os.File) (*spawner.Process, error) {
	return nil, fmt.Errorf("%w: broken on purpose", spawner.ErrUnavailable)
}

// Without a spawner commands enter the sandbox as before: same results,
// on a terminal too.
func TestIsolatedFallbackWithoutSpawner(t *testing.T) {
	f, _ := isolated(t, func(sb *sandbox.Sandbox) Sandbox { return unavailableSpawn{sb} })
	c := f.dial(t)
	out, errOut, code := run(t, c, `echo "parent $(cat /proc/$PPID/comm 2>/dev/null || echo outside)"; wc -c; exit 5`, "hello")
	if out != "parent outside\n5\n" || code != 5 {
		t.Fatalf("got %q %q status %d", out, errOut, code)
	}
	s, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.RequestPty("xterm", 24, 80, ssh.TerminalModes{}); err != nil {
		t.Fatal(err)
	}
	var exit *ssh.ExitError
	if out, err := s.CombinedOutput("sh -i -c 'exit 7'"); !errors.As(err, &exit) || exit.ExitStatus() != 7 {
		t.Fatalf("an interactive shell: %v %q, want exit status 7", err, out)
	}
}

// The sandbox's spawner is started with the agent: the first command does
// not wait for it.
func TestIsolatedSpawnerStartsWithTheAgent(t *testing.T) {
	_, sb := isolated(t, nil)
	ns := pidNamespace(t, sb)
	deadline := time.Now().Add(10 * time.Second)
	for {
		ents, _ := os.ReadDir("/proc")
		for _, e := range ents {
			c, _ := os.ReadFile("/proc/" + e.Name() + "/comm")
			pidns, _ := os.Readlink("/proc/" + e.Name() + "/ns/pid")
			if pidns == ns && strings.TrimSpace(string(c)) == "sandbox-spawner" {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("no spawner in the sandbox before its first command")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// pidNamespace names sb's PID namespace (as /proc/PID/ns/pid reads).
func pidNamespace(t *testing.T, sb *sandbox.Sandbox) string {
	t.Helper()
	ns, err := os.Readlink(strings.TrimSuffix(sb.DevRoot(), "root") + "ns/pid")
	if err != nil {
		t.Fatal(err)
	}
	return ns
}

// TestIsolatedProcessLogsCannotBeRedirected: a sandbox command can read
// its background process's logs (the RWX CLI tails them there) but not
// replace them, neither where they are nor where they used to be (the
// workspace's .git): a start and a restart leave a file outside the
// sandbox that a planted link names as it was.
func TestIsolatedProcessLogsCannotBeRedirected(t *testing.T) {
	f, _ := isolated(t, nil)
	victim := filepath.Join(t.TempDir(), "authorized_keys")
	if err := os.WriteFile(victim, []byte("keep me\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, victim)
	c := f.dial(t)
	plant := "mkdir -p .git/sandbox-processes && for s in stdout stderr; do ln -sf " + victim + " .git/sandbox-processes/web.$s.log; done"
	if _, errOut, code := run(t, c, plant, ""); code != 0 {
		t.Fatalf("planting the links: exit %d: %s", code, errOut)
	}
	rec := directive(t, c, DirectiveProcessStart, map[string]any{"key": "web", "command": "echo served; exec sleep 60"})
	waitFileContent(t, rec.StdoutPath, "served")
	if out, errOut, code := run(t, c, "cat "+rec.StdoutPath, ""); code != 0 || !strings.Contains(out, "served") {
		t.Errorf("reading the log in the sandbox: exit %d, %q %q", code, out, errOut)
	}
	for _, cmd := range []string{"ln -sf " + victim + " " + rec.StdoutPath, "rm -f " + rec.StdoutPath, "echo forged > " + rec.StdoutPath, "chmod 666 " + rec.StdoutPath} {
		if _, _, code := run(t, c, cmd, ""); code == 0 {
			t.Errorf("%q succeeded in the sandbox: the logs' directory must be read-only there", cmd)
		}
	}
	directive(t, c, DirectiveProcessRestart, keyReq{"web"})
	waitFileContent(t, rec.StdoutPath, "served")
	directive(t, c, DirectiveProcessStop, keyReq{"web"})
	if after := snapshot(t, victim); after != before {
		t.Fatalf("the file the planted link names changed: %s, was %s", after, before)
	}
}

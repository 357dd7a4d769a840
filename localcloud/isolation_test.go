//go:build linux

package localcloud

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/sandboxd/sandboxd/internal/testutil"
	"github.com/sandboxd/sandboxd/localcloud/runs"
	"github.com/sandboxd/sandboxd/localcloud/sandbox"
)

func sandboxRun(t *testing.T, sc *ssh.Client, command string) (string, error) {
	t.Helper()
	s, err := sc.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	out, err := s.CombinedOutput(command)
	return strings.TrimSpace(string(out)), err
}

// TestSandboxIsolation: with the default configuration a sandbox command
// cannot read the user's HOME, localcloud's token, TLS key, run registry
// (agent keys) or another run's workspace; cannot write outside its
// workspace; cannot see or signal the server; cannot reach a port on the
// machine's loopback. The status record says so.
func TestSandboxIsolation(t *testing.T) {
	root := isolate(t)
	secret := filepath.Join(os.Getenv("HOME"), "secret")
	if err := os.WriteFile(secret, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	srv := startServer(t, Config{})
	if r := srv.isolationReport(); r == nil || r.Isolation != sandbox.IsolationNamespaces || (r.Network != sandbox.NetworkInternet && r.Network != sandbox.NetworkLoopback) || !slices.Contains(r.Protections, "net-namespace") {
		t.Fatalf("isolation report %+v, want namespaces with a network of the run's own (internet, or loopback without pasta)", r)
	}
	// What `sandboxd-localcloud status --json` prints.
	d, err := Status(context.Background(), srv.Dir())
	if err != nil || d.Isolation == nil || d.Isolation.Isolation != sandbox.IsolationNamespaces || len(d.Isolation.Protections) == 0 {
		t.Fatalf("the discovery record does not say the isolation: %v %+v", err, d.Isolation)
	}
	c := newClient(t, srv)
	a := c.create(repo(t, plainConfig), "")
	b := c.create(repo(t, plainConfig), "")
	c.waitState(a, runs.Sandboxable)
	c.waitState(b, runs.Sandboxable)
	other := filepath.Join(srv.Dir(), "runs", b, "workspace", "README")
	if _, err := os.Stat(other); err != nil {
		t.Fatal(err)
	}
	sc := dialSandbox(t, c.connInfo(a))

	if out, err := sandboxRun(t, sc, "cat README"); err != nil || out != "hello" {
		t.Fatalf("the sandbox cannot read its own workspace: %v %q", err, out)
	}
	unreadable := []string{secret, srv.TokenFile(), filepath.Join(srv.Dir(), certDir, "key.pem"), filepath.Join(srv.Dir(), "runs.json"), other, filepath.Join(root, "home")}
	if os.Geteuid() == 0 {
		// Root's files of the system directories it sees, and one of
		// mode 0600 in its own workspace: a root localcloud's sandbox has
		// no more power over them than an unprivileged user.
		own := filepath.Join(srv.Dir(), "runs", a, "workspace", "root-only")
		if err := os.WriteFile(own, []byte("root\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		for _, p := range []string{"/etc/shadow", own} {
			if out, err := sandboxRun(t, sc, "cat "+p); err == nil {
				t.Errorf("the sandbox of a root localcloud read %s: %q", p, out)
			}
		}
	}
	for _, p := range unreadable {
		if out, err := sandboxRun(t, sc, "cat "+p+" || ls "+p); err == nil {
			t.Errorf("the sandbox read %s: %q", p, out)
		}
	}
	for _, p := range []string{filepath.Join(srv.Dir(), "escape"), filepath.Join(os.Getenv("HOME"), "escape"), "/usr/escape", "/escape"} {
		_, _ = sandboxRun(t, sc, "echo x > "+p)
		if _, err := os.Stat(p); err == nil {
			os.Remove(p)
			t.Errorf("the sandbox wrote %s", p)
		}
	}
	if out, err := sandboxRun(t, sc, "echo x > made && cat made"); err != nil || out != "x" {
		t.Fatalf("the sandbox cannot write its workspace: %v %q", err, out)
	}
	// A command comes from the sandbox's spawner (no cgroup move, no
	// nsenter per command), confined as one that entered the sandbox: no
	// capabilities at all, no_new_privs, the workspace as its directory,
	// the run's environment, the run's cgroups.
	ws := filepath.Join(srv.Dir(), "runs", a, "workspace")
	out, err := sandboxRun(t, sc, `cat /proc/$PPID/comm; grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs):' /proc/self/status; readlink /proc/self/cwd; echo "$RWX_SANDBOX $RWX_WORKSPACE"; cat /proc/self/cgroup`)
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	want := []string{"sandbox-spawner", "CapInh:\t0000000000000000", "CapPrm:\t0000000000000000", "CapEff:\t0000000000000000",
		"CapBnd:\t0000000000000000", "CapAmb:\t0000000000000000", "NoNewPrivs:\t1", ws, "1 " + ws}
	if lines := strings.Split(out, "\n"); len(lines) < len(want) || strings.Join(lines[:len(want)], "\n") != strings.Join(want, "\n") {
		t.Errorf("a command's confinement:\n%s\nwant it to begin with:\n%s", out, strings.Join(want, "\n"))
	}
	if cg := srv.isolationReport().Limits["processes"]; strings.HasPrefix(cg, "cgroup") && !strings.Contains(out, "/sandboxd/nook-") {
		t.Errorf("a command is not in the run's cgroups: %s", out)
	}
	// A terminal is the sandbox's own, named in its /dev/pts.
	ps, err := sc.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	if err := ps.RequestPty("xterm", 24, 80, ssh.TerminalModes{}); err != nil {
		t.Fatal(err)
	}
	if out, err := ps.CombinedOutput("tty"); err != nil || !strings.HasPrefix(strings.TrimSpace(string(out)), "/dev/pts/") {
		t.Errorf("tty in the sandbox: %v %q", err, out)
	}
	// A shell with job control on that terminal takes it and gives it
	// back: it leads its own session inside the sandbox's PID namespace
	// (made outside, the session's group has no number inside, and dash
	// exits 2 with "Cannot set tty process group").
	js, err := sc.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	if err := js.RequestPty("xterm", 24, 80, ssh.TerminalModes{}); err != nil {
		t.Fatal(err)
	}
	var exit *ssh.ExitError
	if out, err := js.CombinedOutput("sh -i -c 'exit 7'"); !errors.As(err, &exit) || exit.ExitStatus() != 7 {
		t.Errorf("an interactive shell on a terminal in the sandbox: %v %q, want exit status 7", err, out)
	}
	// A signal for a command on a terminal reaches it in its session
	// inside (not only the process that entered the namespaces): the
	// session ends with that signal.
	ks, err := sc.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	if err := ks.RequestPty("xterm", 24, 80, ssh.TerminalModes{}); err != nil {
		t.Fatal(err)
	}
	kin, _ := ks.StdinPipe()
	kout, _ := ks.StdoutPipe()
	if err := ks.Shell(); err != nil {
		t.Fatal(err)
	}
	fmt.Fprintln(kin, "echo READY-$((1+1))")
	if !readUntil(kout, "READY-2") {
		t.Fatal("the shell on a terminal did not answer")
	}
	if err := ks.Signal(ssh.SIGKILL); err != nil {
		t.Fatal(err)
	}
	ended := make(chan error, 1)
	go func() { ended <- ks.Wait() }()
	select {
	case err := <-ended:
		if !errors.As(err, &exit) || exit.Signal() != "KILL" {
			t.Errorf("the killed shell's session ended with %v, want signal KILL", err)
		}
	case <-time.After(30 * time.Second):
		_, _ = sandboxRun(t, sc, "kill -9 -1") // frees the server to end
		t.Fatal("the shell's session did not end on SIGKILL: the signal did not reach the shell")
	}
	self := strconv.Itoa(os.Getpid())
	if out, err := sandboxRun(t, sc, "kill -0 "+self+" || ls -d /proc/"+self); err == nil {
		t.Errorf("the sandbox sees the server's pid %s: %q", self, out)
	}
	if out, err := sandboxRun(t, sc, "ps -e -o comm= | grep -v -x -e sh -e ps -e sleep -e bwrap -e setpriv -e grep -e sandbox-spawner"); err == nil {
		t.Errorf("the sandbox sees processes not its own: %q", out)
	}
	// The API listens on this machine's loopback.
	_, port, _ := net.SplitHostPort(srv.httpsLn.Addr().String())
	if out, err := sandboxRun(t, sc, "bash -c 'exec 3<>/dev/tcp/127.0.0.1/"+port+"' && echo connected"); err == nil || strings.Contains(out, "connected") {
		t.Errorf("the sandbox reached the API's port %s on the machine's loopback: %q", port, out)
	}
}

// readUntil reads r until it has seen want (false at the end of r).
func readUntil(r io.Reader, want string) bool {
	var seen []byte
	buf := make([]byte, 4096)
	for {
		n, err := r.Read(buf)
		seen = append(seen, buf[:n]...)
		if strings.Contains(string(seen), want) {
			return true
		}
		if err != nil {
			return false
		}
	}
}

// TestRunOverItsMemoryLimitIsEnded: a command going over the run's memory
// limit is killed, and the run ends saying why.
func TestRunOverItsMemoryLimitIsEnded(t *testing.T) {
	isolate(t)
	srv := startServer(t, Config{Sandbox: sandbox.Options{MemoryBytes: 64 << 20}})
	if srv.isolationReport().Limits["memory"] != "cgroup-v1" {
		testutil.Unavailable(t, fmt.Sprintf("memory is not limited by cgroups here: %+v", srv.isolationReport()), "run as root with cgroup v1")
	}
	c := newClient(t, srv)
	id := c.create(repo(t, plainConfig), "")
	c.waitState(id, runs.Sandboxable)
	bin, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(srv.Dir(), "runs", id, "workspace", "hog"), bin, 0o755); err != nil {
		t.Fatal(err)
	}
	sc := dialSandbox(t, c.connInfo(id))
	if out, err := sandboxRun(t, sc, allocEnv+"="+strconv.Itoa(256<<20)+" ./hog"); err == nil {
		t.Fatalf("256 MiB allocated under a 64 MiB limit: %q", out)
	}
	st := waitCompleted(t, c, id)
	if st.Reason != runs.ReasonFailed || !strings.Contains(st.Detail, "memory limit") {
		t.Fatalf("the run ended with %+v, want failed: memory limit", st)
	}
}

// nobody is the unprivileged user the tests run a server as.
const nobody = 65534

// TestForwardWhenNotRoot: a localcloud that is not root (here the test
// binary re-executed as nobody, with its own HOME) cannot move into a
// sandbox's network namespace; a port forward still reaches a server the
// sandbox listens on, not the machine's listener on the same port.
func TestForwardWhenNotRoot(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to run a server as another user; as a user, every forward test takes this path")
	}
	// Everything nobody reads lives below a directory it can reach.
	base, err := os.MkdirTemp("", "nook-unpriv")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	if err := os.Chmod(base, 0o755); err != nil {
		t.Fatal(err)
	}
	bin, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	exe := filepath.Join(base, "localcloud.test")
	if err := os.WriteFile(exe, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	home := filepath.Join(base, "home")
	if err := os.Mkdir(home, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Setenv("GIT_CONFIG_NOSYSTEM", "1")
	def := repo(t, plainConfig)
	origin := filepath.Join(base, "origin.git")
	if err := os.Rename(def.Git.OriginURL, origin); err != nil {
		t.Fatal(err)
	}
	def.Git.OriginURL = origin
	if err := filepath.Walk(base, func(p string, _ os.FileInfo, err error) error {
		if err != nil || p == base || p == exe {
			return err
		}
		return os.Lchown(p, nobody, nobody)
	}); err != nil {
		t.Fatal(err)
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("host\n"))
			c.Close()
		}
	}()
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)

	dir := filepath.Join(home, "state")
	cmd := exec.Command(exe, "serve", "--state-dir", dir)
	cmd.Env = []string{asBinaryEnv + "=1", "HOME=" + home, "PATH=" + os.Getenv("PATH"), "GIT_CONFIG_NOSYSTEM=1",
		"XDG_STATE_HOME=" + filepath.Join(home, ".local/state"), "XDG_DATA_HOME=" + filepath.Join(home, ".local/share"),
		"XDG_CONFIG_HOME=" + filepath.Join(home, ".config"), "XDG_RUNTIME_DIR=" + filepath.Join(home, "run")}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	var logs strings.Builder
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// SIGTERM: the server ends its sandboxes, and everything in them.
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("server output:\n%s", logs.String())
		}
	})
	c := discoveryClient(t, waitDiscovery(t, dir, cmd.Process.Pid))
	id := c.create(def, "")
	c.waitState(id, runs.Sandboxable)
	ws := filepath.Join(dir, "runs", id, "workspace")
	if err := os.WriteFile(filepath.Join(ws, "listener"), bin, 0o755); err != nil {
		t.Fatal(err)
	}
	sc := dialSandbox(t, c.connInfo(id))
	// Not root either: commands come from the sandbox's spawner, without
	// capabilities. (Not the bounding set: as a user other than root in
	// the sandbox, setpriv has no capability left to drop it with, through
	// the entering chain as well; with no capability and no_new_privs, no
	// program can gain one.)
	if out, err := sandboxRun(t, sc, "cat /proc/$PPID/comm; grep -E '^(CapInh|CapPrm|CapEff|CapAmb|NoNewPrivs):' /proc/self/status"); err != nil ||
		out != "sandbox-spawner\nCapInh:\t0000000000000000\nCapPrm:\t0000000000000000\nCapEff:\t0000000000000000\nCapAmb:\t0000000000000000\nNoNewPrivs:\t1" {
		t.Errorf("a command of a localcloud that is not root: %v %q, want it spawned, without capabilities", err, out)
	}
	s, err := sc.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	out, err := s.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(listenEnv + "=" + port + " ./listener"); err != nil {
		t.Fatal(err)
	}
	line := make([]byte, 64)
	if n, _ := out.Read(line); !strings.HasPrefix(string(line[:n]), "listening") {
		t.Fatalf("the listener in the sandbox did not start: %q", line[:n])
	}
	fc, err := sc.Dial("tcp", "127.0.0.1:"+port)
	if err != nil {
		t.Fatalf("forward to the sandbox's port %s from a localcloud that is not root: %v", port, err)
	}
	defer fc.Close()
	got, _ := io.ReadAll(fc)
	if string(got) != "inside\n" {
		t.Fatalf("the forward reached %q, want the sandbox's listener", got)
	}
}

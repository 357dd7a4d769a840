package daemon

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/internal/testutil"
	"github.com/sandboxd/sandboxd/ipc"
)

// unitDir is packaging/systemd, relative to this package.
const unitDir = "../packaging/systemd"

func requireTool(t *testing.T, name string) string {
	t.Helper()
	return testutil.NeedTool(t, name, "apt-get install systemd")
}

// TestSystemdUnitsVerify runs systemd-analyze verify on the user units,
// as shipped and as `make install` rewrites them, with the built binary in
// place. Any diagnostic (even an "ignoring" warning) fails the test.
func TestSystemdUnitsVerify(t *testing.T) {
	analyze := requireTool(t, "systemd-analyze")
	e := newTestEnv(t)
	home := e.vars["HOME"]
	bin := filepath.Join(home, ".local", "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(sandboxdBin, filepath.Join(bin, "sandboxd")); err != nil {
		t.Fatal(err)
	}
	socketUnit, err := os.ReadFile(filepath.Join(unitDir, "sandboxd.socket"))
	if err != nil {
		t.Fatal(err)
	}
	serviceUnit, err := os.ReadFile(filepath.Join(unitDir, "sandboxd.service"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"ListenStream=%t/sandboxd/sandboxd.sock", "SocketMode=0600", "DirectoryMode=0700"} {
		if !strings.Contains(string(socketUnit), "\n"+want+"\n") {
			t.Errorf("sandboxd.socket lacks %s", want)
		}
	}
	for _, want := range []string{"Type=notify", "WatchdogSec=", "Restart=on-failure", "WantedBy=default.target", "ExecStart=%h/.local/bin/sandboxd"} {
		if !strings.Contains(string(serviceUnit), "\n"+want) {
			t.Errorf("sandboxd.service lacks %s", want)
		}
	}

	// The Makefile's install rule: sed 's|^ExecStart=.*|ExecStart=$(PREFIX)/bin/sandboxd|'.
	prefix := filepath.Join(e.root, "prefix")
	if err := os.MkdirAll(filepath.Join(prefix, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(sandboxdBin, filepath.Join(prefix, "bin", "sandboxd")); err != nil {
		t.Fatal(err)
	}
	installed := regexp.MustCompile(`(?m)^ExecStart=.*$`).ReplaceAll(serviceUnit, []byte("ExecStart="+prefix+"/bin/sandboxd"))

	for name, service := range map[string][]byte{"shipped": serviceUnit, "installed": installed} {
		t.Run(name, func(t *testing.T) {
			dir := filepath.Join(e.root, name)
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			for file, content := range map[string][]byte{"sandboxd.socket": socketUnit, "sandboxd.service": service} {
				if err := os.WriteFile(filepath.Join(dir, file), content, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			// --user needs a runtime dir and a home; no user manager is
			// needed for verify.
			cmd := exec.Command(analyze, "verify", "--user", filepath.Join(dir, "sandboxd.socket"), filepath.Join(dir, "sandboxd.service"))
			cmd.Env = e.environ()
			out, err := cmd.CombinedOutput()
			if err != nil || len(strings.TrimSpace(string(out))) > 0 {
				t.Fatalf("systemd-analyze verify: %v\n%s", err, out)
			}
		})
	}

	// And a broken unit is caught, so the check above means something.
	bad := filepath.Join(e.root, "bad.service")
	if err := os.WriteFile(bad, []byte("[Service]\nType=notify\nExecStart=relative/sandboxd\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(analyze, "verify", "--user", bad)
	cmd.Env = e.environ()
	if out, err := cmd.CombinedOutput(); err == nil && len(strings.TrimSpace(string(out))) == 0 {
		t.Fatal("systemd-analyze verify accepted a broken unit: the check is not working")
	}
}

// activated starts sandboxd under systemd-socket-activate listening on the
// env's socket path and returns the activator (which execs sandboxd on the
// first connection, keeping its pid).
func (e *testEnv) activated(t *testing.T, extra ...string) *proc {
	t.Helper()
	activate := requireTool(t, "systemd-socket-activate")
	if err := os.MkdirAll(filepath.Dir(e.socket()), 0o700); err != nil {
		t.Fatal(err)
	}
	args := []string{activate, "-l", e.socket()}
	env := e.environ(extra...)
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		args = append(args, "-E", k) // systemd-socket-activate passes only what -E names
	}
	p := startProc(t, env, append(args, sandboxdBin)...)
	// The file appears at bind(), before listen(): wait for the listening
	// socket itself (without connecting, which would start the daemon).
	eventually(t, 10*time.Second, "systemd-socket-activate to listen on "+e.socket(), func() bool {
		return unixListening(e.socket())
	})
	return p
}

// unixListening reports whether a Unix socket bound to path is listening,
// from /proc/net/unix (a listening socket has the SO_ACCEPTCON flag,
// 00010000).
func unixListening(path string) bool {
	b, err := os.ReadFile("/proc/net/unix")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		// Num RefCount Protocol Flags Type St Inode Path
		f := strings.Fields(line)
		if len(f) >= 8 && f[7] == path && f[3] == "00010000" {
			return true
		}
	}
	return false
}

func TestSocketActivation(t *testing.T) {
	e := newTestEnv(t)
	e.writeConfig(`{"idle_timeout": "0s"}`) // never idle out during this test
	n := newNotifySocket(t, e.root)
	p := e.activated(t, n.env())

	// The first connection starts the daemon; it answers on the passed
	// socket.
	var v ipc.VersionResponse
	if err := json.Unmarshal([]byte(mustGet(t, e.socket(), "/v1/version")), &v); err != nil {
		t.Fatal(err)
	}
	if v.Version != "test-version" || v.PID != p.cmd.Process.Pid {
		t.Errorf("version %+v; want test-version from pid %d", v, p.cmd.Process.Pid)
	}
	n.waitFor(t, "READY=1", readyTimeout, p)
	var h ipc.HealthResponse
	if err := json.Unmarshal([]byte(mustGet(t, e.socket(), "/v1/health")), &h); err != nil {
		t.Fatal(err)
	}
	if !h.Activated || h.SocketPath != e.socket() {
		t.Errorf("health %+v: want socketActivated and socket %s", h, e.socket())
	}

	p.signal(t, syscall.SIGTERM)
	if code := p.wait(t, exitTimeout); code != 0 {
		t.Fatalf("exit %d", code)
	}
	// The socket belongs to systemd: the daemon leaves it in place.
	if _, err := os.Lstat(e.socket()); err != nil {
		t.Errorf("socket-activated daemon removed the passed socket: %v", err)
	}
}

func TestIdleExitWhenActivated(t *testing.T) {
	e := newTestEnv(t)
	e.writeConfig(`{"idle_timeout": "300ms"}`)
	n := newNotifySocket(t, e.root)
	p := e.activated(t, n.env())
	mustGet(t, e.socket(), "/v1/health")
	n.waitFor(t, "READY=1", readyTimeout, p)
	msg := n.waitFor(t, "STOPPING=1", 10*time.Second, p)
	if !strings.Contains(msg, "idle") {
		t.Errorf("stop reason should say idle: %q", msg)
	}
	if code := p.wait(t, exitTimeout); code != 0 {
		t.Fatalf("idle exit code %d, want 0 (Restart=on-failure must not restart it)", code)
	}
}

func TestSIGHUPReloadsConfig(t *testing.T) {
	e := newTestEnv(t)
	e.writeConfig(`{"idle_timeout": "0s"}`)
	n := newNotifySocket(t, e.root)
	p := e.activated(t, n.env())
	mustGet(t, e.socket(), "/v1/health")
	n.waitFor(t, "READY=1", readyTimeout, p)

	// A broken file is reported with its reason; the daemon keeps serving
	// on the old configuration.
	e.writeConfig(`{"idle_timeout": 5}`)
	p.signal(t, syscall.SIGHUP)
	n.waitFor(t, "RELOADING=1", 5*time.Second, p)
	msg := n.waitFor(t, "READY=1", 5*time.Second, p)
	if !strings.Contains(msg, "configuration reload failed") {
		t.Errorf("status after a failed reload: %q", msg)
	}
	eventually(t, 5*time.Second, "the reload failure in the log", func() bool {
		log := p.stderr.String()
		return strings.Contains(log, "keeping the previous configuration") && strings.Contains(log, `field \"idle_timeout\"`)
	})
	mustGet(t, e.socket(), "/v1/health")
	if p.exited() {
		t.Fatal("daemon died on a broken config reload")
	}

	// A good file takes effect: with an idle timeout now, the activated
	// daemon exits when idle.
	e.writeConfig(`{"idle_timeout": "200ms", "log_level": "debug"}`)
	p.signal(t, syscall.SIGHUP)
	n.waitFor(t, "RELOADING=1", 5*time.Second, p)
	n.waitFor(t, "STOPPING=1", 10*time.Second, p)
	if code := p.wait(t, exitTimeout); code != 0 {
		t.Fatalf("exit %d", code)
	}
	if !strings.Contains(p.stderr.String(), "configuration reloaded") {
		t.Errorf("reload not logged:\n%s", p.stderr)
	}
}

// TestActivatedDaemonRefusedWhileAnotherRuns: a socket-activated daemon
// that finds the lock taken fails fast and names the running daemon.
func TestActivatedDaemonRefusedWhileAnotherRuns(t *testing.T) {
	e := newTestEnv(t)
	n := newNotifySocket(t, e.root)
	own := filepath.Join(e.root, "own.sock")
	first := e.startDaemon(n.env(), "SANDBOXD_SOCKET="+own)
	n.waitFor(t, "READY=1", readyTimeout, first)

	p := e.activated(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, _, _ = get(ctx, e.socket(), "/v1/version") // triggers the start; it fails
	if code := p.wait(t, exitTimeout); code == 0 {
		t.Fatal("second (activated) daemon exited 0")
	}
	if !strings.Contains(p.stderr.String(), "already running (pid") || !strings.Contains(p.stderr.String(), own) {
		t.Errorf("refusal does not name the running daemon:\n%s", p.stderr)
	}
}

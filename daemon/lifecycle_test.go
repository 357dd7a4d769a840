package daemon

import (
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/ipc"
)

const (
	readyTimeout = 15 * time.Second
	exitTimeout  = 15 * time.Second
)

func TestReadyThenStoppingOnSIGTERM(t *testing.T) {
	e := newTestEnv(t)
	n := newNotifySocket(t, e.root)
	d := e.startDaemon(n.env())

	ready := n.waitFor(t, "READY=1", readyTimeout, d)
	if !strings.Contains(ready, "STATUS=serving on "+e.socket()) {
		t.Errorf("READY=1 without the serving status: %q", ready)
	}
	// READY means serving: the socket answers at once.
	var v ipc.VersionResponse
	if err := json.Unmarshal([]byte(mustGet(t, e.socket(), "/v1/version")), &v); err != nil {
		t.Fatal(err)
	}
	if v.Version != "test-version" || v.PID != d.cmd.Process.Pid {
		t.Errorf("version answer %+v, want test-version from pid %d", v, d.cmd.Process.Pid)
	}
	fi, err := os.Stat(e.socket())
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket %s: mode %v, err %v; want 0600", e.socket(), fi.Mode(), err)
	}
	if fi, err := os.Stat(filepath.Dir(e.socket())); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("socket dir: %v %v; want 0700", fi.Mode(), err)
	}
	pid, sock := readPIDFile(e.stateFile("sandboxd.pid"))
	if pid != d.cmd.Process.Pid || sock != e.socket() {
		t.Errorf("pid file says pid %d socket %q", pid, sock)
	}

	d.signal(t, syscall.SIGTERM)
	n.waitFor(t, "STOPPING=1", exitTimeout, d)
	if code := d.wait(t, exitTimeout); code != 0 {
		t.Fatalf("exit code %d after SIGTERM\n%s", code, d.stderr)
	}
	for _, p := range []string{e.socket(), e.stateFile("sandboxd.pid")} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Errorf("%s still exists after a clean stop (err %v)", p, err)
		}
	}
	if _, err := os.Stat(e.stateFile("sandboxd.db")); err != nil {
		t.Errorf("database gone after stop: %v", err)
	}
}

func TestSecondDaemonRefused(t *testing.T) {
	e := newTestEnv(t)
	n := newNotifySocket(t, e.root)
	first := e.startDaemon(n.env())
	n.waitFor(t, "READY=1", readyTimeout, first)

	start := time.Now()
	second := e.startDaemon()
	code := second.wait(t, exitTimeout)
	if code == 0 {
		t.Fatalf("second daemon exited 0\n%s", second.stderr)
	}
	msg := second.stderr.String()
	want := "sandboxd is already running (pid " + strconv.Itoa(first.cmd.Process.Pid) + ", socket " + e.socket() + ")"
	if !strings.Contains(msg, want) || !strings.Contains(msg, "nook daemon stop") {
		t.Errorf("second daemon said %q; want it to contain %q and how to stop it", msg, want)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("second daemon took %s to give up; it should fail fast", took)
	}
	// The first one is untouched: still serving, socket and pid file kept.
	mustGet(t, e.socket(), "/v1/health")
	if pid, _ := readPIDFile(e.stateFile("sandboxd.pid")); pid != first.cmd.Process.Pid {
		t.Errorf("pid file now names %d", pid)
	}
}

func TestStaleSocketRecovered(t *testing.T) {
	e := newTestEnv(t)
	n := newNotifySocket(t, e.root)
	first := e.startDaemon(n.env())
	n.waitFor(t, "READY=1", readyTimeout, first)
	first.signal(t, syscall.SIGKILL)
	first.wait(t, exitTimeout)
	if fi, err := os.Lstat(e.socket()); err != nil || fi.Mode().Type() != os.ModeSocket {
		t.Fatalf("the killed daemon should have left its socket behind: %v", err)
	}

	second := e.startDaemon(n.env())
	n.waitFor(t, "READY=1", readyTimeout, second)
	var h ipc.HealthResponse
	if err := json.Unmarshal([]byte(mustGet(t, e.socket(), "/v1/health")), &h); err != nil {
		t.Fatal(err)
	}
	if h.Status != "ok" || h.Store != "ok" || h.SocketPath != e.socket() {
		t.Errorf("health after recovery: %+v", h)
	}
	if !strings.Contains(second.stderr.String(), "removed a stale socket") {
		t.Errorf("recovery not logged:\n%s", second.stderr)
	}
	if pid, _ := readPIDFile(e.stateFile("sandboxd.pid")); pid != second.cmd.Process.Pid {
		t.Errorf("pid file names %d, want %d", pid, second.cmd.Process.Pid)
	}
}

func TestNonSocketInTheWayIsLeftAlone(t *testing.T) {
	e := newTestEnv(t)
	if err := os.MkdirAll(filepath.Dir(e.socket()), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(e.socket(), []byte("precious"), 0o600); err != nil {
		t.Fatal(err)
	}
	d := e.startDaemon()
	if code := d.wait(t, exitTimeout); code == 0 {
		t.Fatal("daemon started over a regular file")
	}
	if !strings.Contains(d.stderr.String(), "is not a socket") {
		t.Errorf("unclear error: %s", d.stderr)
	}
	if b, err := os.ReadFile(e.socket()); err != nil || string(b) != "precious" {
		t.Errorf("the file in the way was touched: %q %v", b, err)
	}
	if _, err := os.Stat(e.stateFile("sandboxd.pid")); !os.IsNotExist(err) {
		t.Errorf("pid file left behind by a daemon that failed to start: %v", err)
	}
}

func TestSocketPathTooLong(t *testing.T) {
	e := newTestEnv(t)
	long := filepath.Join(e.root, strings.Repeat("d", 120), "sandboxd.sock")
	d := e.startDaemon("SANDBOXD_SOCKET=" + long)
	if code := d.wait(t, exitTimeout); code == 0 {
		t.Fatal("daemon accepted a socket path over the limit")
	}
	msg := d.stderr.String()
	for _, want := range []string{long, strconv.Itoa(MaxSocketPathLen), "SANDBOXD_SOCKET"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q does not mention %q", msg, want)
		}
	}
}

func TestSocketOverrides(t *testing.T) {
	e := newTestEnv(t)
	n := newNotifySocket(t, e.root)
	envSock := filepath.Join(e.root, "env.sock")
	flagSock := filepath.Join(e.root, "flag.sock")
	d := startProc(t, e.environ(n.env(), "SANDBOXD_SOCKET="+envSock), sandboxdBin, "--socket", flagSock)
	n.waitFor(t, "READY=1", readyTimeout, d)
	mustGet(t, flagSock, "/v1/version")
	if _, err := os.Lstat(envSock); !os.IsNotExist(err) {
		t.Errorf("--socket should beat SANDBOXD_SOCKET, but %s exists", envSock)
	}
	d.signal(t, syscall.SIGINT)
	if code := d.wait(t, exitTimeout); code != 0 {
		t.Fatalf("exit %d on SIGINT", code)
	}
	if _, err := os.Lstat(flagSock); !os.IsNotExist(err) {
		t.Errorf("own socket not removed on stop")
	}
}

func TestStopOverTheSocket(t *testing.T) {
	e := newTestEnv(t)
	n := newNotifySocket(t, e.root)
	d := e.startDaemon(n.env())
	n.waitFor(t, "READY=1", readyTimeout, d)
	c, err := net.Dial("unix", e.socket())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("POST /v1/daemon/stop HTTP/1.1\r\nHost: sandboxd\r\nContent-Length: 0\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 512)
	k, _ := c.Read(buf)
	if !strings.HasPrefix(string(buf[:k]), "HTTP/1.1 202") {
		t.Errorf("stop answered %q", buf[:k])
	}
	n.waitFor(t, "STOPPING=1", exitTimeout, d)
	if code := d.wait(t, exitTimeout); code != 0 {
		t.Fatalf("exit %d after a stop request", code)
	}
}

func TestWatchdogPings(t *testing.T) {
	e := newTestEnv(t)
	n := newNotifySocket(t, e.root)
	d := e.startDaemon(n.env(), "WATCHDOG_USEC=100000") // 100ms: pings every 50ms
	n.waitFor(t, "READY=1", readyTimeout, d)
	for i := 0; i < 3; i++ {
		n.waitFor(t, "WATCHDOG=1", 5*time.Second, d)
	}
}

func TestNoWatchdogPingsWhenOff(t *testing.T) {
	e := newTestEnv(t)
	n := newNotifySocket(t, e.root)
	// WATCHDOG_PID names another process: the watchdog is not ours.
	d := e.startDaemon(n.env(), "WATCHDOG_USEC=50000", "WATCHDOG_PID=1")
	n.waitFor(t, "READY=1", readyTimeout, d)
	mustGet(t, e.socket(), "/v1/health")
	d.signal(t, syscall.SIGTERM)
	d.wait(t, exitTimeout)
	for msg := range n.msgs {
		if strings.Contains(msg, "WATCHDOG=1") {
			t.Fatalf("watchdog pinged although WATCHDOG_PID is another process")
		}
		if strings.Contains(msg, "STOPPING=1") {
			break
		}
	}
}

func TestNoIdleExitWithoutActivation(t *testing.T) {
	e := newTestEnv(t)
	e.writeConfig(`{"idle_timeout": "100ms"}`)
	n := newNotifySocket(t, e.root)
	d := e.startDaemon(n.env())
	n.waitFor(t, "READY=1", readyTimeout, d)
	// Ten idle timeouts: a daemon the user started by hand stays.
	time.Sleep(time.Second)
	if d.exited() {
		t.Fatalf("daemon exited when idle although not socket-activated\n%s", d.stderr)
	}
	mustGet(t, e.socket(), "/v1/health")
}

func TestBrokenConfigAtStart(t *testing.T) {
	e := newTestEnv(t)
	e.writeConfig(`{"idle_timout": "1m"}`)
	d := e.startDaemon()
	if code := d.wait(t, exitTimeout); code == 0 {
		t.Fatal("daemon started with a broken config")
	}
	msg := d.stderr.String()
	if !strings.Contains(msg, e.configFile()) || !strings.Contains(msg, `unknown field "idle_timout"`) {
		t.Errorf("error does not name the file and field: %s", msg)
	}
}

func TestVersionFlag(t *testing.T) {
	e := newTestEnv(t)
	p := startProc(t, e.environ(), sandboxdBin, "--version")
	if code := p.wait(t, exitTimeout); code != 0 || strings.TrimSpace(p.stderr.String()) != "sandboxd test-version" {
		t.Fatalf("--version: exit %d, %q", code, p.stderr)
	}
	p = startProc(t, e.environ(), sandboxdBin, "--print-socket")
	if code := p.wait(t, exitTimeout); code != 0 || strings.TrimSpace(p.stderr.String()) != e.socket() {
		t.Fatalf("--print-socket: exit %d, %q, want %s", code, p.stderr, e.socket())
	}
	p = startProc(t, e.environ(), sandboxdBin, "--log-level", "loud")
	if code := p.wait(t, exitTimeout); code == 0 || !strings.Contains(p.stderr.String(), "loud") {
		t.Fatalf("bad --log-level: exit %d, %q", code, p.stderr)
	}
}

package daemon

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

// sandboxdBin is the sandboxd binary built once for the tests that run real
// daemon processes.
var sandboxdBin string

func TestMain(m *testing.M) {
	os.Exit(testMain(m))
}

func testMain(m *testing.M) int {
	dir, err := os.MkdirTemp("", "nookd-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	gobin, err := exec.LookPath("go")
	if err != nil {
		gobin = "/usr/local/go/bin/go" // where .ci/run and the README expect Go
	}
	sandboxdBin = filepath.Join(dir, "sandboxd")
	cmd := exec.Command(gobin, "build", "-o", sandboxdBin, "-ldflags", "-X main.Version=test-version", "github.com/sandboxd/sandboxd/cmd/sandboxd")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build sandboxd:", err)
		return 1
	}
	return m.Run()
}

// testEnv is one isolated user: HOME, XDG directories and a runtime dir in
// a short temp dir (socket paths must stay short).
type testEnv struct {
	t    testing.TB
	root string
	vars map[string]string
}

func newTestEnv(t testing.TB) *testEnv {
	t.Helper()
	root, err := os.MkdirTemp("", "nookd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	e := &testEnv{t: t, root: root, vars: map[string]string{
		"HOME":            filepath.Join(root, "home"),
		"XDG_STATE_HOME":  filepath.Join(root, "state"),
		"XDG_CONFIG_HOME": filepath.Join(root, "config"),
		"XDG_DATA_HOME":   filepath.Join(root, "data"),
		"XDG_RUNTIME_DIR": filepath.Join(root, "run"),
		"PATH":            os.Getenv("PATH"),
	}}
	for _, k := range []string{"HOME", "XDG_RUNTIME_DIR"} {
		if err := os.MkdirAll(e.vars[k], 0o700); err != nil {
			t.Fatal(err)
		}
	}
	return e
}

func (e *testEnv) lookup(k string) (string, bool) { v, ok := e.vars[k]; return v, ok }

func (e *testEnv) socket() string {
	if s := e.vars["SANDBOXD_SOCKET"]; s != "" {
		return s
	}
	return filepath.Join(e.vars["XDG_RUNTIME_DIR"], "sandboxd", "sandboxd.sock")
}

func (e *testEnv) stateFile(name string) string {
	return filepath.Join(e.vars["XDG_STATE_HOME"], "sandboxd", name)
}

func (e *testEnv) configFile() string {
	return filepath.Join(e.vars["XDG_CONFIG_HOME"], "sandboxd", "config.json")
}

func (e *testEnv) writeConfig(content string) {
	e.t.Helper()
	if err := os.MkdirAll(filepath.Dir(e.configFile()), 0o700); err != nil {
		e.t.Fatal(err)
	}
	// Atomic, so a daemon reloading meanwhile never reads half a file.
	tmp := e.configFile() + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		e.t.Fatal(err)
	}
	if err := os.Rename(tmp, e.configFile()); err != nil {
		e.t.Fatal(err)
	}
}

// environ is the process environment: only the test's variables (never
// the test process's NOTIFY_SOCKET, LISTEN_FDS, XDG dirs) plus extra.
func (e *testEnv) environ(extra ...string) []string {
	var out []string
	for k, v := range e.vars {
		out = append(out, k+"="+v)
	}
	return append(out, extra...)
}

// proc is a running process of the tests.
type proc struct {
	cmd    *exec.Cmd
	stderr *testutil.LockedBuffer
	done   chan struct{}
	err    error
}

// startProc starts argv with env; t.Cleanup kills it if it still runs.
func startProc(t testing.TB, env []string, argv ...string) *proc {
	t.Helper()
	p := &proc{cmd: exec.Command(argv[0], argv[1:]...), stderr: &testutil.LockedBuffer{}, done: make(chan struct{})}
	p.cmd.Env = env
	p.cmd.Stdout, p.cmd.Stderr = p.stderr, p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("%s output:\n%s", filepath.Base(argv[0]), p.stderr)
		}
	})
	return p
}

// startDaemon starts the built sandboxd.
func (e *testEnv) startDaemon(extra ...string) *proc {
	e.t.Helper()
	return startProc(e.t, e.environ(extra...), sandboxdBin)
}

// wait waits for the process to exit and returns its exit code.
func (p *proc) wait(t testing.TB, timeout time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(timeout):
		t.Fatalf("process did not exit within %s\n%s", timeout, p.stderr)
	}
	if p.cmd.ProcessState == nil {
		t.Fatalf("process ended without a state: %v", p.err)
	}
	return p.cmd.ProcessState.ExitCode()
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *proc) signal(t testing.TB, sig syscall.Signal) {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signal %s: %v", sig, err)
	}
}

// notifySocket plays the service manager's side of sd_notify: a unixgram
// socket whose datagrams are collected in order.
type notifySocket struct {
	path string
	msgs chan string
}

func newNotifySocket(t testing.TB, dir string) *notifySocket {
	t.Helper()
	n := &notifySocket{path: filepath.Join(dir, "notify.sock"), msgs: make(chan string, 256)}
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: n.path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	go func() {
		buf := make([]byte, 4096)
		for {
			k, err := conn.Read(buf)
			if err != nil {
				close(n.msgs)
				return
			}
			n.msgs <- string(buf[:k])
		}
	}()
	return n
}

func (n *notifySocket) env() string { return "NOTIFY_SOCKET=" + n.path }

// waitFor returns the first datagram with a line equal to line (or, for a
// "KEY=" argument, starting with it), failing the test after timeout.
func (n *notifySocket) waitFor(t testing.TB, line string, timeout time.Duration, p *proc) string {
	t.Helper()
	deadline := time.After(timeout)
	var seen []string
	for {
		select {
		case msg, ok := <-n.msgs:
			if !ok {
				t.Fatalf("notify socket closed before %q; saw %q", line, seen)
			}
			seen = append(seen, msg)
			for _, l := range strings.Split(msg, "\n") {
				if l == line || (strings.HasSuffix(line, "=") && strings.HasPrefix(l, line)) {
					return msg
				}
			}
		case <-deadline:
			out := ""
			if p != nil {
				out = p.stderr.String()
			}
			t.Fatalf("no %q on the notify socket within %s; saw %q\n%s", line, timeout, seen, out)
		}
	}
}

// get does one plain HTTP GET over the Unix socket, on a fresh connection.
func get(ctx context.Context, socket, path string) (int, string, error) {
	tr := &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", socket)
	}}
	defer tr.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://sandboxd"+path, nil)
	if err != nil {
		return 0, "", err
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

func mustGet(t testing.TB, socket, path string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	code, body, err := get(ctx, socket, path)
	if err != nil || code != http.StatusOK {
		t.Fatalf("GET %s on %s: %d %s %v", path, socket, code, body, err)
	}
	return body
}

// eventually polls cond every 20ms until it holds or timeout passes.
func eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

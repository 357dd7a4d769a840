// Package e2e holds the end-to-end tests: the real sandboxd, nook and
// sandboxd-localcloud binaries, built once per run, talking over a real Unix
// socket to real sandbox agents, on real git repositories, each test in its
// own HOME and XDG directories.
package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/internal/testutil"
	"github.com/sandboxd/sandboxd/internal/userenv"
)

// binDir holds the binaries built for this run.
var binDir, markerDir string

// defaultParallel is how many tests marked parallel run at once by
// default (go test's default is the number of CPUs).
const defaultParallel = 4

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	var err error
	// Marker and counter files that tests read from outside a sandbox live
	// here; every env's local remote shares it with its (isolated)
	// sandboxes, whose /tmp is private.
	if markerDir, err = os.MkdirTemp("", "nookmark"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(markerDir)
	// A root localcloud's sandboxes run as an unprivileged user (nobody),
	// which must write there.
	if err := os.Chmod(markerDir, 0o1777); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer testutil.Cleanup()
	if binDir, err = testutil.Binaries(raceEnabled, "github.com/sandboxd/sandboxd/cmd/sandboxd", "github.com/sandboxd/sandboxd/cmd/nook", "github.com/sandboxd/sandboxd/cmd/nook/nook-mcp", "github.com/sandboxd/sandboxd/cmd/sandboxd-localcloud", "github.com/sandboxd/sandboxd/cmd/sandboxd-helper"); err != nil {
		fmt.Fprintln(os.Stderr, "build binaries:", err)
		return 1
	}
	// The tests wait on processes (daemons, local remotes, sandboxes) far
	// more than they compute: more of them run at once than there are
	// CPUs, unless -test.parallel says how many.
	flag.Parse()
	parallelSet := false
	flag.Visit(func(f *flag.Flag) { parallelSet = parallelSet || f.Name == "test.parallel" })
	if !parallelSet {
		_ = flag.Set("test.parallel", strconv.Itoa(max(defaultParallel, runtime.GOMAXPROCS(0))))
	}
	return m.Run()
}

// env is one isolated user: its own HOME, XDG directories and socket.
type env struct {
	t    testing.TB
	root string
	vars []string
	// daemon is the last sandboxd started, whose goroutines a nook that
	// outlives nookBound prints.
	daemon *daemon
}

// nookBound bounds one nook run: a wait the daemon never ends fails its
// test with both processes' goroutines instead of the suite's timeout.
const nookBound = 5 * time.Minute

func newEnv(t testing.TB) *env {
	t.Helper()
	root, err := os.MkdirTemp("", "nooke2e")
	if err != nil {
		t.Fatal(err)
	}
	// Shared with the sandboxes too (see markerDir).
	if err := os.Chmod(root, 0o1777); err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, root: root}
	vars, err := userenv.Vars(root, binDir, "e2e")
	if err != nil {
		t.Fatal(err)
	}
	// The local remote's sandboxes are isolated; the tests' commands leave
	// markers in this scratch directory, so it is shared.
	e.vars = append(vars, "SANDBOXD_LOCALCLOUD_SHARE="+root+","+markerDir, testutil.RaceEnv())
	t.Cleanup(func() {
		e.stopLocalcloud()
		logs, _ := filepath.Glob(filepath.Join(e.get("XDG_DATA_HOME"), "sandboxd", "localcloud", "*.log"))
		for _, l := range logs {
			if b, _ := os.ReadFile(l); strings.Contains(string(b), raceReport) {
				t.Errorf("the race detector fired in sandboxd-localcloud (%s):\n%s", l, b)
			}
		}
		os.RemoveAll(root)
	})
	return e
}

// with returns the environment with extra variables appended.
func (e *env) with(extra ...string) []string {
	return append(append([]string(nil), e.vars...), extra...)
}

func (e *env) get(key string) string { return userenv.Get(e.vars, key) }

func (e *env) socket() string { return userenv.Socket(e.vars) }

// daemon is a running sandboxd.
type daemon struct {
	cmd  *exec.Cmd
	logs *bytes.Buffer
	done chan error
}

// startDaemon runs sandboxd in the foreground of a subprocess and waits for
// its socket to answer.
func (e *env) startDaemon(extra ...string) *daemon {
	e.t.Helper()
	d := &daemon{logs: &bytes.Buffer{}, done: make(chan error, 1)}
	d.cmd = exec.Command(filepath.Join(binDir, "sandboxd"))
	d.cmd.Env = e.with(extra...)
	d.cmd.Stdout, d.cmd.Stderr = d.logs, d.logs
	if err := d.cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	go func() { d.done <- d.cmd.Wait() }()
	e.daemon = d
	e.t.Cleanup(func() { d.stop(e.t) })
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if _, err := e.api("GET", "/v1/health", nil); err == nil {
			return d
		}
		select {
		case err := <-d.done:
			d.done <- err
			e.t.Fatalf("sandboxd exited early: %v\n%s", err, d.logs)
		case <-time.After(20 * time.Millisecond):
		}
	}
	e.t.Fatalf("sandboxd did not answer on %s\n%s", e.socket(), d.logs)
	return nil
}

// stop ends the daemon with SIGTERM (idempotent).
func (d *daemon) stop(t testing.TB) {
	if d.cmd.ProcessState != nil {
		return
	}
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-d.done:
		d.done <- err
	case <-time.After(20 * time.Second):
		// SIGQUIT: the Go runtime prints every goroutine, which says what
		// the shutdown waits for; the logs are read once the process ended.
		_ = d.cmd.Process.Signal(syscall.SIGQUIT)
		select {
		case err := <-d.done:
			d.done <- err
		case <-time.After(5 * time.Second):
			_ = d.cmd.Process.Kill()
			d.done <- <-d.done
		}
		t.Errorf("sandboxd did not stop on SIGTERM\n%s", d.logs)
	}
	if strings.Contains(d.logs.String(), raceReport) {
		t.Errorf("the race detector fired in sandboxd:\n%s", d.logs)
	}
}

// raceReport starts a report of the race detector in a binary's output.
const raceReport = "WARNING: DATA RACE"

// kill ends the daemon with SIGKILL.
func (d *daemon) kill() {
	_ = d.cmd.Process.Kill()
	err := <-d.done
	d.done <- err
}

// stopLocalcloud stops the local remote the daemon started, if any.
func (e *env) stopLocalcloud() {
	discovery := filepath.Join(e.get("XDG_DATA_HOME"), "sandboxd", "localcloud", "localcloud.json")
	b, err := os.ReadFile(discovery)
	if err != nil {
		return
	}
	var d struct {
		PID int `json:"pid"`
	}
	if json.Unmarshal(b, &d) != nil || d.PID <= 0 {
		return
	}
	cmd := exec.Command(filepath.Join(binDir, "sandboxd-localcloud"), "stop")
	cmd.Env = e.vars
	_ = cmd.Run()
	for i := 0; i < 100 && syscall.Kill(d.PID, 0) == nil; i++ {
		time.Sleep(50 * time.Millisecond)
	}
	_ = syscall.Kill(d.PID, syscall.SIGKILL)
}

// result is what a finished nook said.
type result struct {
	code           int
	stdout, stderr string
}

func (r result) String() string {
	return fmt.Sprintf("exit %d\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
}

// nook runs ./bin/nook in dir and waits for it.
func (e *env) nook(dir string, args ...string) result {
	e.t.Helper()
	return e.nookIn(dir, nil, args...)
}

func (e *env) nookIn(dir string, stdin io.Reader, args ...string) result {
	e.t.Helper()
	cmd := e.nookCmd(dir, args...)
	cmd.Stdin = stdin
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Start(); err != nil {
		e.t.Fatalf("run nook %v: %v", args, err)
	}
	// SIGQUIT: the Go runtime prints every goroutine of nook (on its
	// stderr) and of the daemon (in its logs).
	hung := time.AfterFunc(nookBound, func() {
		_ = cmd.Process.Signal(syscall.SIGQUIT)
		if d := e.daemon; d != nil {
			_ = d.cmd.Process.Signal(syscall.SIGQUIT)
		}
	})
	err := cmd.Wait()
	if !hung.Stop() {
		daemonLogs := ""
		if d := e.daemon; d != nil {
			select {
			case derr := <-d.done:
				d.done <- derr
				daemonLogs = d.logs.String()
			case <-time.After(10 * time.Second):
			}
		}
		e.t.Errorf("nook %v did not end within %s; its stderr:\n%s\nsandboxd's logs:\n%s", args, nookBound, errb.String(), daemonLogs)
	}
	code := 0
	if err != nil {
		ee, ok := err.(*exec.ExitError)
		if !ok {
			e.t.Fatalf("run nook %v: %v", args, err)
		}
		code = ee.ExitCode()
	}
	if strings.Contains(errb.String(), raceReport) {
		e.t.Errorf("the race detector fired in nook %v:\n%s", args, errb.String())
	}
	return result{code: code, stdout: out.String(), stderr: errb.String()}
}

func (e *env) nookCmd(dir string, args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(binDir, "nook"), args...)
	cmd.Dir = dir
	cmd.Env = e.vars
	return cmd
}

// mustNook runs nook and fails the test unless it exits 0.
func (e *env) mustNook(dir string, args ...string) result {
	e.t.Helper()
	r := e.nook(dir, args...)
	if r.code != 0 {
		e.t.Fatalf("nook %v: %s", args, r)
	}
	return r
}

// httpClient talks HTTP over the daemon's socket.
func (e *env) httpClient() *http.Client {
	return &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", e.socket())
	}}, Timeout: 60 * time.Second}
}

// api sends one request to the daemon and returns the body; a non-2xx status
// is an error carrying the body.
func (e *env) api(method, path string, body any) ([]byte, error) {
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, _ := http.NewRequest(method, "http://sandboxd"+path, rd)
	resp, err := e.httpClient().Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode/100 != 2 {
		return b, &statusError{resp.StatusCode, string(b)}
	}
	return b, nil
}

type statusError struct {
	code int
	body string
}

func (s *statusError) Error() string { return strconv.Itoa(s.code) + ": " + s.body }

// git runs git in dir and returns its trimmed output.
func (e *env) git(dir string, args ...string) string {
	e.t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	cmd.Env = e.vars
	out, err := cmd.CombinedOutput()
	if err != nil {
		e.t.Fatalf("git %v in %s: %v\n%s", args, dir, err, out)
	}
	return strings.TrimSpace(string(out))
}

// defaultConfig is a sandbox config with no setup steps.
const defaultConfig = `tasks:
  - key: sandbox
    run: rwx-sandbox
`

// newRepo makes a repository with an origin (a bare repository on this
// machine), a README and a sandbox config, committed and pushed.
func (e *env) newRepo(name, config string) string {
	e.t.Helper()
	origin := filepath.Join(e.root, "origins", name+".git")
	repo := filepath.Join(e.root, "src", name)
	if err := os.MkdirAll(filepath.Dir(origin), 0o755); err != nil {
		e.t.Fatal(err)
	}
	e.git(e.root, "init", "-q", "--bare", "-b", "main", origin)
	e.git(e.root, "clone", "-q", origin, repo)
	e.git(repo, "checkout", "-q", "-B", "main")
	writeFile(e.t, filepath.Join(repo, "README.md"), "hello\n")
	writeFile(e.t, filepath.Join(repo, ".rwx", "sandbox.yml"), config)
	e.git(repo, "add", "-A")
	e.git(repo, "commit", "-q", "-m", "init")
	e.git(repo, "push", "-q", "-u", "origin", "main")
	return repo
}

func writeFile(t testing.TB, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func readFile(t testing.TB, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// events follows the daemon's event stream in the background.
type eventLog struct {
	ch   chan map[string]any
	stop func()
	last map[string]any // the last event read, kept to say why a stream ended
}

func (e *env) followEvents(since string) *eventLog {
	e.t.Helper()
	path := "/v1/events"
	if since != "" {
		path += "?since=" + since
	}
	req, _ := http.NewRequest("GET", "http://sandboxd"+path, nil)
	ctx, cancel := context.WithCancel(context.Background())
	req = req.WithContext(ctx)
	c := e.httpClient()
	c.Timeout = 0
	resp, err := c.Do(req)
	if err != nil {
		cancel()
		e.t.Fatal(err)
	}
	l := &eventLog{ch: make(chan map[string]any, 1024), stop: func() { cancel(); resp.Body.Close() }}
	go func() {
		defer close(l.ch)
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			var ev map[string]any
			if json.Unmarshal(sc.Bytes(), &ev) == nil {
				l.ch <- ev
			}
		}
	}()
	e.t.Cleanup(l.stop)
	return l
}

// waitFor reads events until match returns true or the timeout passes.
func (l *eventLog) waitFor(t testing.TB, timeout time.Duration, what string, match func(map[string]any) bool) map[string]any {
	t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case ev, ok := <-l.ch:
			if !ok {
				t.Fatalf("event stream ended while waiting for %s; its last event: %v", what, l.last)
			}
			l.last = ev
			if match(ev) {
				return ev
			}
		case <-deadline:
			t.Fatalf("no %s event within %s", what, timeout)
		}
	}
}

func eventType(typ string) func(map[string]any) bool {
	return func(ev map[string]any) bool { return ev["type"] == typ }
}

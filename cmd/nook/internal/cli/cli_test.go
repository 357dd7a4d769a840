package cli

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/daemon/paths"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/internal/testutil"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
	"github.com/sandboxd/sandboxd/ipc/ipctest"
	"github.com/sandboxd/sandboxd/ipc/server"
)

func TestParse(t *testing.T) {
	hostile := []string{"--json", "-i", "--", "a b", `"q"`, "$HOME", "*", "line\nbreak", "ünï"}
	cases := []struct {
		args    []string
		cmd     string
		json    bool
		bools   []string
		strs    map[string]string
		lists   map[string][]string
		pos     []string
		argv    []string
		wantErr string
	}{
		{args: []string{"version"}, cmd: "version"},
		{args: []string{"--json", "version"}, cmd: "version", json: true},
		{args: []string{"version", "--json"}, cmd: "version", json: true},
		{args: []string{"daemon", "status", "--json"}, cmd: "daemon status", json: true},
		{args: []string{"start", "cfg.yml", "--wait", "--id=run-1", "--init", "a=1", "--init", "b=x=y"}, cmd: "start",
			bools: []string{"wait"}, strs: map[string]string{"id": "run-1"}, lists: map[string][]string{"init": {"a=1", "b=x=y"}}, pos: []string{"cfg.yml"}},
		{args: []string{"exec", "--no-sync", "-i", "--", "printf", "%s"}, cmd: "exec", bools: []string{"no-sync", "interactive"}, argv: []string{"printf", "%s"}},
		{args: append([]string{"--json", "exec", "c.yml", "--id", "r", "--"}, hostile...), cmd: "exec", json: true,
			strs: map[string]string{"id": "r"}, pos: []string{"c.yml"}, argv: hostile},
		{args: []string{"list", "--all"}, cmd: "list", bools: []string{"all"}},
		{args: []string{"stop", "--all", "--json"}, cmd: "stop", json: true, bools: []string{"all"}},
		{args: []string{"exec", "--", "sh", "-c", "exit 3"}, cmd: "exec", argv: []string{"sh", "-c", "exit 3"}},
		{args: []string{"exec", "--help"}, cmd: "exec"},
		{args: []string{"exec", "make"}, wantErr: "no command given"},
		{args: []string{"exec", "--"}, wantErr: "no command given"},
		{args: []string{"start", "--bogus"}, wantErr: "unknown flag --bogus"},
		{args: []string{"start", "--id"}, wantErr: "needs a value"},
		{args: []string{"start", "--wait=yes"}, wantErr: "takes no value"},
		{args: []string{"start", "a", "b"}, wantErr: "too many arguments: b"},
		{args: []string{"list", "--", "x"}, wantErr: "takes no command after --"},
		{args: []string{"frobnicate"}, wantErr: `unknown command "frobnicate"`},
		{args: []string{"daemon"}, wantErr: "needs a subcommand"},
		{args: []string{"daemon", "restart"}, wantErr: `unknown command "daemon restart"`},
	}
	for _, c := range cases {
		p, err := parse(root(), c.args)
		if c.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), c.wantErr) || !errors.Is(err, errUsage) {
				t.Errorf("%q: error %v, want %q", c.args, err, c.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q: %v", c.args, err)
			continue
		}
		if p.cmd.path() != c.cmd || p.json() != c.json {
			t.Errorf("%q: command %q json %v", c.args, p.cmd.path(), p.json())
		}
		for _, b := range c.bools {
			if !p.bools[b] {
				t.Errorf("%q: --%s not set", c.args, b)
			}
		}
		for k, v := range c.strs {
			if p.strings[k] != v {
				t.Errorf("%q: --%s = %q, want %q", c.args, k, p.strings[k], v)
			}
		}
		for k, v := range c.lists {
			if !reflect.DeepEqual(p.lists[k], v) {
				t.Errorf("%q: --%s = %q, want %q", c.args, k, p.lists[k], v)
			}
		}
		if len(c.pos) > 0 && !reflect.DeepEqual(p.args, c.pos) {
			t.Errorf("%q: args %q, want %q", c.args, p.args, c.pos)
		}
		if len(c.argv) > 0 && !reflect.DeepEqual(p.argv, c.argv) {
			t.Errorf("%q: argv %q, want %q", c.args, p.argv, c.argv)
		}
	}
}

func TestExitCode(t *testing.T) {
	for _, c := range []struct {
		res  ipc.ExecResult
		want int
	}{
		{ipc.ExecResult{ExitCode: 0}, 0},
		{ipc.ExecResult{ExitCode: 1}, 1},
		{ipc.ExecResult{ExitCode: 7}, 7},
		{ipc.ExecResult{ExitCode: 130, Signal: "INT"}, 130},
		{ipc.ExecResult{Signal: "KILL"}, 137},
		{ipc.ExecResult{Signal: "TERM"}, 143},
		{ipc.ExecResult{Signal: "WEIRD", ExitCode: 200}, 200},
		{ipc.ExecResult{Signal: "WEIRD"}, 255},
		{ipc.ExecResult{ExitCode: 300}, 255},
		{ipc.ExecResult{ExitCode: -1}, 255},
	} {
		if got := ExitCode(c.res); got != c.want {
			t.Errorf("ExitCode(%+v) = %d, want %d", c.res, got, c.want)
		}
	}
}

func TestSignalForwarderDoubleInterrupt(t *testing.T) {
	now := time.Unix(1000, 0)
	disconnects := 0
	f := newSignalForwarder(func() time.Time { return now }, func() { disconnects++ })
	f.commandStarted()
	f.handle(syscall.SIGINT)
	if got := <-f.out; got != "INT" || disconnects != 0 {
		t.Fatalf("first Ctrl-C: %q", got)
	}
	now = now.Add(3 * time.Second) // outside the window: forwarded again
	f.handle(syscall.SIGINT)
	if got := <-f.out; got != "INT" {
		t.Fatalf("late second Ctrl-C: %q", got)
	}
	f.handle(syscall.SIGTERM)
	f.handle(syscall.SIGHUP)
	if a, b := <-f.out, <-f.out; a != "TERM" || b != "HUP" {
		t.Fatalf("TERM/HUP forwarded as %q %q", a, b)
	}
	now = now.Add(time.Second) // within 2s of the last Ctrl-C: disconnect
	f.handle(syscall.SIGINT)
	if cancelled, started := f.disconnected(); !cancelled || !started || disconnects != 1 || len(f.out) != 0 {
		t.Fatalf("quick second Ctrl-C: disconnected=%v calls=%d queued=%d", cancelled, disconnects, len(f.out))
	}
}

// Before the command started, one signal of any kind disconnects: there is
// nothing to forward it to, and the wait (a sandbox, the lock) must end.
func TestSignalBeforeTheCommandStartedDisconnects(t *testing.T) {
	for _, sig := range []os.Signal{syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP} {
		disconnects := 0
		f := newSignalForwarder(time.Now, func() { disconnects++ })
		f.handle(sig)
		if cancelled, started := f.disconnected(); !cancelled || started || disconnects != 1 || len(f.out) != 0 {
			t.Fatalf("%v before start: cancelled=%v started=%v calls=%d queued=%d", sig, cancelled, started, disconnects, len(f.out))
		}
	}
}

// harness runs Main against a fake daemon.
type harness struct {
	t              *testing.T
	srv            *ipctest.Server
	env            map[string]string
	stdin          io.Reader
	stdinTerminal  bool
	stdout, stderr testutil.LockedBuffer
	signals        chan<- os.Signal
	mu             sync.Mutex
	startDaemon    func(ctx context.Context, l paths.Layout, c *client.Client) error
	mcp            func(ctx context.Context, o MCPOptions) error
	cwd            string
}

func newHarness(t *testing.T) *harness {
	h := &harness{t: t, srv: ipctest.Start(t, ipctest.Options{Server: server.Options{Version: "v1.0.0"}}), cwd: "/work/repo"}
	home := t.TempDir()
	h.env = map[string]string{"HOME": home, "XDG_STATE_HOME": filepath.Join(home, "state"), "SANDBOXD_SOCKET": h.srv.Socket}
	return h
}

func (h *harness) run(args ...string) int {
	h.stdout.Reset()
	h.stderr.Reset()
	stdin := h.stdin
	if stdin == nil {
		stdin = strings.NewReader("")
	}
	sys := System{
		Stdin: stdin, Stdout: &h.stdout, Stderr: &h.stderr, StdinIsTerminal: h.stdinTerminal,
		Env:   func(k string) (string, bool) { v, ok := h.env[k]; return v, ok },
		Getwd: func() (string, error) { return h.cwd, nil },
		Notify: func(c chan<- os.Signal, _ ...os.Signal) {
			h.mu.Lock()
			h.signals = c
			h.mu.Unlock()
		},
		StopNotify:  func(chan<- os.Signal) {},
		Now:         time.Now,
		Version:     "v1.0.0",
		StartDaemon: h.startDaemon,
		MCP:         h.mcp,
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return Main(ctx, args, sys)
}

func (h *harness) lastRequest() any {
	r := h.srv.Sessions.Requests()
	if len(r) == 0 {
		h.t.Fatal("no request reached the daemon")
	}
	return r[len(r)-1]
}

func TestExecPassesArgvAndStdinAndExitCode(t *testing.T) {
	h := newHarness(t)
	h.srv.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		st.Send(ipc.ExecOutput{Type: ipc.ExecWarning, Message: "config drift: run `nook reset`"})
		in, _ := io.ReadAll(st.Stdin())
		st.Stdout().Write(in)
		st.Stderr().Write([]byte("to stderr\n"))
		return ipc.ExecResult{RunID: "run-9", RunURL: "https://x/run-9", ExitCode: 7, PulledFiles: []string{"a.txt"}}, nil
	}
	h.stdin = strings.NewReader("piped input")
	argv := []string{"printf", "%s\n", "a b", `it's "q"`, "$HOME", "*.go", "new\nline", "ünï", "--json"}
	code := h.run(append([]string{"exec", "--no-sync", "--"}, argv...)...)
	if code != 7 {
		t.Fatalf("exit %d, stderr %s", code, h.stderr.String())
	}
	req := h.lastRequest().(ipc.ExecRequest)
	if !reflect.DeepEqual(req.Argv, argv) || !req.NoSync || !req.Stdin || req.Cwd != "/work/repo" {
		t.Fatalf("request %+v", req)
	}
	if h.stdout.String() != "piped input" {
		t.Fatalf("stdout %q", h.stdout.String())
	}
	if !strings.Contains(h.stderr.String(), "to stderr\n") || !strings.Contains(h.stderr.String(), "nook: warning: config drift: run `nook reset`") {
		t.Fatalf("stderr %q", h.stderr.String())
	}

	// --json: stdout is NDJSON records only: the warning, the output
	// chunks with their stream, then the result; stderr stays empty.
	h.stdin = strings.NewReader("piped\xffbytes")
	if code := h.run("exec", "--json", "--", "true"); code != 7 {
		t.Fatalf("--json exit %d", code)
	}
	lines := strings.Split(strings.TrimSpace(h.stdout.String()), "\n")
	var recs []map[string]any
	for _, l := range lines {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("--json line %q: %v", l, err)
		}
		recs = append(recs, m)
	}
	var stdoutBytes []byte
	var sawWarning, sawStderr bool
	for _, m := range recs[:len(recs)-1] {
		switch {
		case m["type"] == "warning":
			sawWarning = true
		case m["type"] == "output" && m["stream"] == "stdout":
			if s, ok := m["text"].(string); ok {
				stdoutBytes = append(stdoutBytes, s...)
			} else {
				b, _ := base64.StdEncoding.DecodeString(m["base64"].(string))
				stdoutBytes = append(stdoutBytes, b...)
			}
		case m["type"] == "output" && m["stream"] == "stderr":
			sawStderr = m["text"] == "to stderr\n"
		default:
			t.Fatalf("unexpected record %v", m)
		}
	}
	if string(stdoutBytes) != "piped\xffbytes" || !sawWarning || !sawStderr || h.stderr.Len() != 0 {
		t.Fatalf("--json records %q stderr %q", h.stdout.String(), h.stderr.String())
	}
	var out execJSON
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &out); err != nil {
		t.Fatalf("--json output %q: %v", h.stdout.String(), err)
	}
	if out.Type != "result" || out.RunID != "run-9" || out.ExitCode != 7 || out.RunURL != "https://x/run-9" || !reflect.DeepEqual(out.PulledFiles, []string{"a.txt"}) {
		t.Fatalf("--json %+v", out)
	}

	// A terminal stdin is not forwarded unless -i.
	h.stdinTerminal = true
	h.run("exec", "--", "true")
	if h.lastRequest().(ipc.ExecRequest).Stdin {
		t.Fatal("terminal stdin forwarded without -i")
	}
	h.run("exec", "-i", "--", "true")
	if !h.lastRequest().(ipc.ExecRequest).Stdin {
		t.Fatal("-i did not forward stdin")
	}
}

func TestExecFailuresExit125(t *testing.T) {
	h := newHarness(t)
	h.srv.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		if req.RunID == "gone" {
			return ipc.ExecResult{}, errdefs.NotFoundf("no session for run gone: attach to it with `nook start --id gone`")
		}
		return ipc.ExecResult{ExitCode: 130, Signal: "INT"}, nil
	}
	if code := h.run("exec", "--id", "gone", "--", "true"); code != 125 || !strings.Contains(h.stderr.String(), "nook: no session for run gone") {
		t.Fatalf("exit %d stderr %q", code, h.stderr.String())
	}
	if code := h.run("exec", "--", "sh", "-c", "kill -INT $$"); code != 130 {
		t.Fatalf("signal death exit %d", code)
	}
	if code := h.run("exec", "--bogus", "--", "true"); code != 125 || !strings.Contains(h.stderr.String(), "usage: nook exec") {
		t.Fatalf("usage error exit %d stderr %q", code, h.stderr.String())
	}
	h.env["SANDBOXD_NO_AUTOSTART"] = "1"
	h.env["SANDBOXD_SOCKET"] = filepath.Join(h.srv.Dir, "missing.sock")
	if code := h.run("exec", "--", "true"); code != 125 || !strings.Contains(h.stderr.String(), "not running") || !strings.Contains(h.stderr.String(), "SANDBOXD_NO_AUTOSTART=1") {
		t.Fatalf("no daemon: exit %d stderr %q", code, h.stderr.String())
	}
}

func TestExecForwardsSignals(t *testing.T) {
	h := newHarness(t)
	got := make(chan string, 1)
	h.srv.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		st.Send(ipc.ExecOutput{Type: ipc.ExecStarted})
		st.Stdout().Write([]byte("running\n"))
		select {
		case s := <-st.Signals():
			got <- s
			return ipc.ExecResult{ExitCode: 143, Signal: "TERM"}, nil
		case <-ctx.Done():
			return ipc.ExecResult{}, errdefs.Canceled(ctx.Err())
		}
	}
	go func() {
		for {
			h.mu.Lock()
			c := h.signals
			h.mu.Unlock()
			// Signals are forwarded once nook saw the command start (the
			// output behind the started frame tells).
			if c != nil && strings.Contains(h.stdout.String(), "running") {
				c <- syscall.SIGTERM
				return
			}
			time.Sleep(time.Millisecond)
		}
	}()
	if code := h.run("exec", "--", "sleep", "9"); code != 143 {
		t.Fatalf("exit %d stderr %q", code, h.stderr.String())
	}
	if s := <-got; s != "TERM" {
		t.Fatalf("remote got %q", s)
	}
}

func TestSessionCommands(t *testing.T) {
	h := newHarness(t)
	if code := h.run("start", "--wait", "--init", "k=v", "--timeout", "90s", "--json", "sub/cfg.yml"); code != 0 {
		t.Fatalf("start: %d %s", code, h.stderr.String())
	}
	sr := h.lastRequest().(ipc.StartRequest)
	if !sr.Wait || sr.Init["k"] != "v" || sr.WaitTimeoutSeconds != 90 || sr.ConfigFile != "sub/cfg.yml" || sr.Cwd != "/work/repo" {
		t.Fatalf("start request %+v", sr)
	}
	var st ipc.StartResponse
	if err := json.Unmarshal(h.stdout.Bytes(), &st); err != nil || st.Session.RunID != "run-1" || !st.Created {
		t.Fatalf("start --json %q %v", h.stdout.String(), err)
	}
	if code := h.run("start", "--init", "novalue"); code != 125 || !strings.Contains(h.stderr.String(), "KEY=VALUE") {
		t.Fatalf("bad --init: %d %q", code, h.stderr.String())
	}
	if code := h.run("reset", "--wait"); code != 0 || !strings.Contains(h.stdout.String(), "Stopped run-1; started run-2") {
		t.Fatalf("reset: %d %q", code, h.stdout.String())
	}
	now := time.Now()
	h.srv.Sessions.ListFn = func(context.Context, ipc.ListRequest) (ipc.ListResponse, error) {
		return ipc.ListResponse{Sessions: []ipc.SessionInfo{{RunID: "run-1", Status: "ready", RepoRoot: "/r", Branch: "main", ConfigFile: "/r/.rwx/sandbox.yml", LastExecAt: &now}}}, nil
	}
	if code := h.run("list", "--all"); code != 0 || !strings.Contains(h.stdout.String(), "RUN") || !strings.Contains(h.stdout.String(), ".rwx/sandbox.yml") || !strings.Contains(h.stdout.String(), "0s ago") {
		t.Fatalf("list: %d %q", code, h.stdout.String())
	}
	if !h.lastRequest().(ipc.ListRequest).All {
		t.Fatal("--all not sent")
	}
	if code := h.run("stop", "--all", "--id", "x"); code != 125 {
		t.Fatalf("stop --all --id: %d", code)
	}
	if code := h.run("stop", "--id", "run-1", "--json"); code != 0 || strings.TrimSpace(h.stdout.String()) != `{"stopped":[]}` {
		t.Fatalf("stop: %d %q", code, h.stdout.String())
	}
	if r := h.lastRequest().(ipc.StopRequest); r.RunID != "run-1" || r.All {
		t.Fatalf("stop request %+v", r)
	}
	if code := h.run("status", "--json"); code != 0 || !strings.Contains(h.stdout.String(), `"probe":"connected"`) {
		t.Fatalf("status: %d %q", code, h.stdout.String())
	}
	if code := h.run("init", ".rwx/x.yml"); code != 0 || !strings.Contains(h.stdout.String(), "Wrote ") {
		t.Fatalf("init: %d %q", code, h.stdout.String())
	}
	if r := h.lastRequest().(ipc.InitRequest); r.File != ".rwx/x.yml" || r.Cwd != "/work/repo" {
		t.Fatalf("init request %+v", r)
	}
	if code := h.run("config"); code != 0 || !strings.Contains(h.stdout.String(), "local") {
		t.Fatalf("config: %d %q", code, h.stdout.String())
	}
}

func TestVersionAndDaemonCommands(t *testing.T) {
	h := newHarness(t)
	if code := h.run("version", "--json"); code != 0 || h.stderr.Len() != 0 {
		t.Fatalf("version: %d %q", code, h.stderr.String())
	}
	var v versionJSON
	if err := json.Unmarshal(h.stdout.Bytes(), &v); err != nil || v.Client.Version != "v1.0.0" || v.Daemon.Version != "v1.0.0" || v.Mismatch {
		t.Fatalf("version --json %q %v", h.stdout.String(), err)
	}
	var raw struct{ Client map[string]any }
	if json.Unmarshal(h.stdout.Bytes(), &raw); raw.Client["pid"] != nil || raw.Client["startedAt"] != nil {
		t.Fatalf("the client's version has a pid or start time: %q", h.stdout.String())
	}
	if code := h.run("--version"); code != 0 || !strings.Contains(h.stdout.String(), "nook       v1.0.0") {
		t.Fatalf("nook --version: %d %q %q", code, h.stdout.String(), h.stderr.String())
	}
	other := ipctest.Start(t, ipctest.Options{Server: server.Options{Version: "v0.9.0"}})
	h.env["SANDBOXD_SOCKET"] = other.Socket
	if code := h.run("version"); code != 0 || strings.Count(h.stderr.String(), "\n") != 1 || !strings.Contains(h.stderr.String(), "nook v1.0.0 and sandboxd v0.9.0 differ") {
		t.Fatalf("mismatch: %d %q", code, h.stderr.String())
	}
	if code := h.run("daemon", "status"); code != 0 || !strings.Contains(h.stdout.String(), "running") {
		t.Fatalf("daemon status: %d %q", code, h.stdout.String())
	}
	h.env["SANDBOXD_SOCKET"] = filepath.Join(other.Dir, "none.sock")
	if code := h.run("daemon", "status", "--json"); code != ExitNotRunning || !strings.Contains(h.stdout.String(), `"running":false`) {
		t.Fatalf("daemon status without daemon: %d %q", code, h.stdout.String())
	}
	if code := h.run("daemon", "stop"); code != 0 || !strings.Contains(h.stdout.String(), "not running") {
		t.Fatalf("daemon stop without daemon: %d %q", code, h.stdout.String())
	}
	if code := h.run("--help"); code != 0 || !strings.Contains(h.stdout.String(), "Commands:") {
		t.Fatalf("help: %d", code)
	}
	if code := h.run("exec", "-h"); code != 0 || !strings.Contains(h.stdout.String(), "--no-sync") {
		t.Fatalf("exec help: %d %q", code, h.stdout.String())
	}
	// nook help [cmd], nook daemon --help, nook --version.
	if code := h.run("help"); code != 0 || !strings.Contains(h.stdout.String(), "Commands:") {
		t.Fatalf("nook help: %d %q", code, h.stdout.String())
	}
	if code := h.run("help", "exec"); code != 0 || !strings.Contains(h.stdout.String(), "Usage: nook exec") {
		t.Fatalf("nook help exec: %d %q", code, h.stdout.String())
	}
	if code := h.run("help", "daemon", "stop"); code != 0 || !strings.Contains(h.stdout.String(), "Usage: nook daemon stop") {
		t.Fatalf("nook help daemon stop: %d %q", code, h.stdout.String())
	}
	if code := h.run("help", "nope"); code != 125 || !strings.Contains(h.stderr.String(), "unknown command") {
		t.Fatalf("nook help nope: %d %q", code, h.stderr.String())
	}
	if code := h.run("daemon", "--help"); code != 0 || !strings.Contains(h.stdout.String(), "status") || !strings.Contains(h.stdout.String(), "stop") || strings.Contains(h.stdout.String()+h.stderr.String(), "run `nook daemon --help`") {
		t.Fatalf("nook daemon --help: %d %q %q", code, h.stdout.String(), h.stderr.String())
	}
	if code := h.run("daemon"); code != 125 || !strings.Contains(h.stderr.String(), "nook help daemon") {
		t.Fatalf("nook daemon: %d %q", code, h.stderr.String())
	}
}

// When no daemon answers, nook starts one and sends the request again.
func TestAutostartRetries(t *testing.T) {
	h := newHarness(t)
	dir, err := os.MkdirTemp("", "nook")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "d.sock")
	h.env["SANDBOXD_SOCKET"] = sock
	starts := 0
	h.startDaemon = func(ctx context.Context, l paths.Layout, c *client.Client) error {
		starts++
		if l.Socket != sock {
			t.Errorf("autostart for socket %s, want %s", l.Socket, sock)
		}
		ipctest.Start(t, ipctest.Options{Socket: sock, Server: server.Options{Version: "v1.0.0"}})
		return nil
	}
	if code := h.run("list", "--json"); code != 0 || starts != 1 {
		t.Fatalf("list with autostart: %d starts=%d %q", code, starts, h.stderr.String())
	}
	h.env["SANDBOXD_SOCKET"] = filepath.Join(dir, "other.sock")
	h.startDaemon = func(context.Context, paths.Layout, *client.Client) error {
		return errors.New("sandboxd exited before serving (exit status 1):\nstore is corrupt")
	}
	if code := h.run("list"); code != 125 || !strings.Contains(h.stderr.String(), "store is corrupt") {
		t.Fatalf("failed autostart: %d %q", code, h.stderr.String())
	}
	h.env["SANDBOXD_NO_AUTOSTART"] = "1"
	starts = 0
	h.startDaemon = func(context.Context, paths.Layout, *client.Client) error { starts++; return nil }
	if code := h.run("list"); code != 125 || starts != 0 {
		t.Fatalf("SANDBOXD_NO_AUTOSTART=1 started a daemon (%d) or exit %d", starts, code)
	}
}

// nook mcp hands its server the checkout, the output bound and its whole
// command line (which nook passes on to nook-mcp); bad options fail in nook.
func TestMCPHandsOverItsCommandLine(t *testing.T) {
	h := newHarness(t)
	var got *MCPOptions
	h.mcp = func(_ context.Context, o MCPOptions) error { got = &o; return nil }
	if code := h.run("mcp", "--dir", "/work/other", "--max-output", "2048"); code != ExitOK || got == nil {
		t.Fatalf("nook mcp: exit %d, server called: %v\n%s", code, got != nil, h.stderr.String())
	}
	if got.Dir != "/work/other" || got.MaxOutput != 2048 || !reflect.DeepEqual(got.Args, []string{"mcp", "--dir", "/work/other", "--max-output", "2048"}) || got.Client == nil || got.Ensure == nil {
		t.Fatalf("server options %+v", *got)
	}
	got = nil
	if code := h.run("mcp"); code != ExitOK || got == nil || got.Dir != h.cwd || got.MaxOutput != 0 {
		t.Fatalf("nook mcp without options: exit %d, options %+v", code, got)
	}
	got = nil
	if code := h.run("mcp", "--max-output", "12"); code != ExitFailure || got != nil || !strings.Contains(h.stderr.String(), "at least 1024") {
		t.Fatalf("nook mcp --max-output 12: exit %d, server called %v\n%s", code, got != nil, h.stderr.String())
	}
}

// Without nook-mcp next to nook or on PATH, nook mcp says what is missing and
// how to get it.
func TestExecMCPMissingBinary(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	err := execMCP(context.Background(), MCPOptions{Args: []string{"mcp"}})
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "nook-mcp, which is neither next to this nook nor on PATH") || !strings.Contains(err.Error(), "make install") {
		t.Fatalf("execMCP without nook-mcp: %v", err)
	}
}

package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"
	"golang.org/x/sys/unix"
)

// TestLocalRemotePrintsNoRunURL: the local remote's run URL is its API's
// (it answers 401 to a browser, and goes stale when it restarts), so
// start, bg start, status, list and exec show none.
func TestLocalRemotePrintsNoRunURL(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("nourl", defaultConfig)
	other := e.newRepo("nourlbg", defaultConfig)
	outs := []result{
		e.mustNook(repo, "start", "--wait"),
		e.mustNook(other, "start"),
		e.mustNook(repo, "bg", "start", "--name", "s", "--", "sleep", "60"),
		e.mustNook(repo, "bg", "list"),
		e.mustNook(repo, "status"),
		e.mustNook(repo, "list", "--json"),
		e.mustNook(repo, "exec", "--json", "--", "true"),
	}
	for _, r := range outs {
		if s := r.stdout + r.stderr; strings.Contains(s, "/runs/") || strings.Contains(s, "runUrl") {
			t.Errorf("a run URL of the local remote was printed: %s", r)
		}
	}
}

// TestBgForwardTakesTheSamePortShowsProgressAndADeadForward: `bg start
// --port P` listens on local port P when it is free (curl :P works); a
// port that does not open shows progress within seconds instead of
// silence; after the local remote restarts (the process died with it),
// `bg list` says the forward is dead and how to bring it back.
func TestBgForwardTakesTheSamePortShowsProgressAndADeadForward(t *testing.T) {
	t.Parallel()
	python := sandboxPython(t)
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("samport", defaultConfig)
	e.startSandbox(repo)
	port := freePort(t)
	r := e.mustNook(repo, "bg", "start", "--name", "web", "--port", fmt.Sprint(port), "--", python, "-m", "http.server", fmt.Sprint(port), "--bind", "127.0.0.1")
	want := fmt.Sprintf("http://127.0.0.1:%d", port)
	if !strings.Contains(r.stdout, want) {
		t.Fatalf("bg start --port %d did not forward local port %d: %s", port, port, r)
	}
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get(want + "/")
	if err != nil {
		t.Fatalf("GET %s: %v", want, err)
	}
	resp.Body.Close()

	// A port that never opens: progress on stderr within a few seconds.
	never := freePort(t)
	cmd := e.nookCmd(repo, "bg", "start", "--name", "never", "--port", fmt.Sprint(never), "--", "sleep", "600")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	got := make(chan string, 1)
	go func() {
		var b strings.Builder
		buf := make([]byte, 4096)
		for {
			n, err := stderr.Read(buf)
			b.Write(buf[:n])
			if strings.Contains(b.String(), fmt.Sprintf("port %d", never)) || err != nil {
				got <- b.String()
				return
			}
		}
	}()
	select {
	case s := <-got:
		if !strings.Contains(s, "waiting for port") {
			t.Errorf("bg start on a port that does not open said: %q", s)
		}
	case <-time.After(8 * time.Second):
		t.Errorf("bg start on a port that does not open was silent for 8s")
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()

	// The local remote dies and comes back: the process died with it.
	pid := localcloudPID(t, e)
	if err := unix.Kill(pid, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 10*time.Second, "the local remote to die", func() bool { return unix.Kill(pid, 0) != nil })
	// The first exec brings the local remote back; one that races the
	// daemon learning the new connection details may fail once (exit 125,
	// never run twice), which is not what this test is about.
	waitUntil(t, 30*time.Second, "an exec after the local remote restarted", func() bool {
		return e.nook(repo, "exec", "--no-sync", "--", "true").code == 0
	})
	r = e.mustNook(repo, "bg", "list")
	var line string
	for _, l := range strings.Split(r.stdout, "\n") {
		if strings.HasPrefix(l, "web ") {
			line = l
		}
	}
	if !strings.Contains(line, "dead") || !strings.Contains(line, "nook bg restart web") || strings.Contains(line, "unknown") {
		t.Fatalf("bg list after the local remote restarted does not show web's forward as dead: %s", r)
	}
	// What it says brings it back.
	e.mustNook(repo, "bg", "restart", "web")
	waitUntil(t, 30*time.Second, "the restarted server to answer on "+want, func() bool {
		resp, err := (&http.Client{Timeout: 5 * time.Second}).Get(want + "/")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil
	})
}

// TestMCPProgressCancelHintsAndOutputOnce: an MCP exec that creates the
// sandbox sends progress notifications for its progressToken; its result
// holds the output once (text, not again in structured content); a hint
// names the tools' runId, not nook's --id RUN; the exec tool says what
// the sandbox has and where commands run; a cancelled exec is answered as
// cancelled, not with the transport's "context canceled".
func TestMCPProgressCancelHintsAndOutputOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("mcpprog", defaultConfig)

	var mu sync.Mutex
	var notes []string
	cmd := e.nookCmd(repo, "mcp")
	c := sdk.NewClient(&sdk.Implementation{Name: "e2e", Version: "1"}, &sdk.ClientOptions{
		ProgressNotificationHandler: func(_ context.Context, req *sdk.ProgressNotificationClientRequest) {
			mu.Lock()
			notes = append(notes, req.Params.Message)
			mu.Unlock()
		},
	})
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cs, err := c.Connect(ctx, &sdk.CommandTransport{Command: cmd}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Close()

	tools, err := cs.ListTools(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, tool := range tools.Tools {
		if tool.Name == "exec" && (!strings.Contains(tool.Description, "internet") || !strings.Contains(tool.Description, "toolchains") || !strings.Contains(tool.Description, "corresponds to cwd")) {
			t.Errorf("the exec tool does not say what the sandbox has and where commands run: %s", tool.Description)
		}
	}

	params := &sdk.CallToolParams{Name: "exec", Arguments: map[string]any{"command": "echo marker-$((6*7))"}}
	params.SetProgressToken("create")
	res, err := cs.CallTool(ctx, params)
	if err != nil || res.IsError {
		t.Fatalf("exec: %v %+v", err, res)
	}
	b, _ := json.Marshal(res)
	if n := strings.Count(string(b), "marker-42"); n != 1 {
		t.Errorf("the exec result holds the output %d times, want once: %s", n, b)
	}
	mu.Lock()
	got := append([]string(nil), notes...)
	mu.Unlock()
	if len(got) == 0 {
		t.Errorf("no progress notification while the sandbox was created")
	}

	// A hint of the daemon's, outside a git checkout: runId, not --id RUN.
	plain := t.TempDir()
	res, _ = callTool(t, e.mcpSession(t, plain), "status", nil)
	if txt := toolText(res); !res.IsError || strings.Contains(txt, "--id RUN") || !strings.Contains(txt, "runId") {
		t.Errorf("outside a checkout, the hint does not name the tool's runId: %s", txt)
	}

	// Cancelled while the command runs: the answer, read raw, says so.
	raw := e.nookCmd(repo, "mcp")
	in, _ := raw.StdinPipe()
	out, _ := raw.StdoutPipe()
	if err := raw.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = raw.Process.Kill(); _ = raw.Wait() }()
	lines := make(chan string, 64)
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	send := func(s string) { _, _ = io.WriteString(in, s+"\n") }
	send(`{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"raw","version":"1"}}}`)
	<-lines
	send(`{"jsonrpc":"2.0","method":"notifications/initialized"}`)
	send(`{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"exec","arguments":{"command":"sleep 30"}}}`)
	time.Sleep(2 * time.Second)
	send(`{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":2,"reason":"the user pressed Esc"}}`)
	deadline := time.After(15 * time.Second)
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				return
			}
			if !strings.Contains(l, `"id":2`) {
				continue
			}
			if strings.Contains(l, "context canceled") || !strings.Contains(l, "cancelled") {
				t.Errorf("the cancelled exec was answered: %s", l)
			}
			return
		case <-deadline:
			t.Errorf("no answer to the cancelled exec within 15s")
			return
		}
	}
}

// TestNeovimQuickfixReadsPythonTracebacksInTheCheckout: `:Nook quickfix`
// after a Python traceback gives valid entries for its frames, at the
// files of the local checkout (not the sandbox's …/runs/<id>/workspace
// paths the traceback names).
func TestNeovimQuickfixReadsPythonTracebacksInTheCheckout(t *testing.T) {
	t.Parallel()
	nvim := needTool(t, "nvim", "apt-get install neovim")
	sandboxPython(t)
	plugin, err := filepath.Abs(filepath.Join("..", "..", "contrib", "nvim"))
	if err != nil {
		t.Fatal(err)
	}
	script, err := filepath.Abs(filepath.Join("testdata", "nvim_quickfix.lua"))
	if err != nil {
		t.Fatal(err)
	}
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("nvimqf", defaultConfig)
	writeFile(t, filepath.Join(repo, "pkg", "boom.py"), "def boom():\n    raise ValueError('boom')\n\nboom()\n")
	e.mustNook(repo, "start", "--wait")

	outFile := filepath.Join(e.root, "nvim.json")
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, nvim, "--headless", "-u", "NONE", "-i", "NONE", "-n",
		"--cmd", "set rtp^="+plugin, "-c", "luafile "+script)
	cmd.Dir = repo
	cmd.Env = e.with("NOOK_NVIM_OUT=" + outFile)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("nvim: %v\n%s", err, out)
	}
	got := decode[struct {
		Error    string `json:"error"`
		Text     string `json:"text"`
		Quickfix []struct {
			File string `json:"file"`
			Lnum int    `json:"lnum"`
		} `json:"quickfix"`
	}](t, readFile(t, outFile))
	if got.Error != "" || !strings.Contains(got.Text, "ValueError: boom") {
		t.Fatalf("the traceback was not shown: %+v", got)
	}
	want := map[int]bool{4: false, 2: false}
	local := filepath.Join(repo, "pkg", "boom.py")
	for _, q := range got.Quickfix {
		if q.File != local {
			t.Errorf("quickfix entry at %s:%d, want the checkout's %s", q.File, q.Lnum, local)
		}
		if _, ok := want[q.Lnum]; ok {
			want[q.Lnum] = true
		}
	}
	if !want[2] || !want[4] {
		t.Errorf("quickfix lacks the traceback's frames (lines 4 and 2 of boom.py): %+v\n%s", got.Quickfix, got.Text)
	}
}

// TestExecFailsFastOutsideARepoAndOnAHugeUntrackedFile: outside a git
// checkout nook exec fails at once (the daemon does not wait for a stream
// it has not answered); a 100 MiB untracked file is refused, naming it,
// from its size, on the first exec and the next, without being read.
func TestExecFailsFastOutsideARepoAndOnAHugeUntrackedFile(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	plain := t.TempDir()
	e.nook(plain, "exec", "--", "true") // the daemon warm
	// The fastest of three: the suite's load can stretch one call, while
	// a server that waits for the stream adds its second to each.
	var r result
	took := time.Hour
	for range 3 {
		start := time.Now()
		r = e.nook(plain, "exec", "--", "true")
		took = min(took, time.Since(start))
	}
	if r.code == 0 || took > 500*time.Millisecond || !strings.Contains(r.stderr, "not inside a git repository") {
		t.Errorf("exec outside a checkout took %s at best of three: %s", took, r)
	}

	repo := e.newRepo("huge", defaultConfig)
	e.startSandbox(repo)
	e.mustNook(repo, "exec", "--", "true")
	f, err := os.Create(filepath.Join(repo, "dump.bin"))
	if err != nil {
		t.Fatal(err)
	}
	// Incompressible, as a real dump is: staging it would take seconds.
	rng := rand.NewChaCha8([32]byte{1})
	if _, err := io.CopyN(f, rng, 100<<20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	for i := 0; i < 2; i++ {
		start := time.Now()
		r := e.nook(repo, "exec", "--", "true")
		took := time.Since(start)
		if r.code == 0 || !strings.Contains(r.stderr, "dump.bin") || !strings.Contains(r.stderr, "limit") {
			t.Fatalf("exec %d with a 100 MiB untracked file: %s", i+1, r)
		}
		if took > 2*time.Second {
			t.Errorf("exec %d refused the 100 MiB file after %s: it was read, not measured", i+1, took)
		}
	}
}

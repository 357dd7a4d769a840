package mcp

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
	"github.com/sandboxd/sandboxd/ipc/ipctest"
)

type rpcAnswer struct {
	ID     json.RawMessage `json:"id"`
	Result json.RawMessage `json:"result"`
	Error  *struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

// TestServeAnswersMalformedLinesAndKeepsServing: lines that are not JSON,
// not an object (a batch, empty or not) or not a JSON-RPC message are each
// answered with the JSON-RPC error that says so (-32700, -32600, with the
// request's id when it has a usable one), and the requests after them are
// served.
func TestServeAnswersMalformedLinesAndKeepsServing(t *testing.T) {
	srv := ipctest.Start(t, ipctest.Options{})
	c := client.New(srv.Socket)
	t.Cleanup(c.Close)
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ServeIO(ctx, Options{Client: c, Dir: t.TempDir(), Version: "test"}, inR, outW) }()
	t.Cleanup(func() {
		cancel()
		inW.Close()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Error("ServeIO did not end after its input closed")
		}
	})
	answers := make(chan rpcAnswer, 16)
	go func() {
		sc := bufio.NewScanner(outR)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			var a rpcAnswer
			if err := json.Unmarshal(sc.Bytes(), &a); err != nil {
				t.Errorf("the server wrote a line that is not JSON: %q", sc.Text())
				continue
			}
			answers <- a
		}
	}()
	send := func(line string) {
		t.Helper()
		if _, err := io.WriteString(inW, line+"\n"); err != nil {
			t.Fatalf("write %q: %v", line, err)
		}
	}
	next := func(what string) rpcAnswer {
		t.Helper()
		select {
		case a := <-answers:
			return a
		case <-time.After(10 * time.Second):
			t.Fatalf("no answer to %s within 10s", what)
		}
		return rpcAnswer{}
	}
	for _, c := range []struct {
		line, id string
		code     int
	}{
		{`{not json}`, "null", codeParseError},
		{`[]`, "null", codeInvalidRequest},
		{`[{"jsonrpc":"2.0","id":1,"method":"ping"}]`, "null", codeInvalidRequest},
		{`42`, "null", codeInvalidRequest},
		{`{"jsonrpc":"2.0","id":7,"method":3}`, "7", codeInvalidRequest},
		{`{"jsonrpc":"2.0","id":{"x":1},"method":"ping"}`, "null", codeInvalidRequest},
		{`{"id":8}`, "8", codeInvalidRequest},
	} {
		send(c.line)
		a := next(c.line)
		if a.Error == nil || a.Error.Code != c.code || string(a.ID) != c.id || a.Error.Message == "" {
			t.Fatalf("answer to %s = id %s, error %+v; want code %d with id %s", c.line, a.ID, a.Error, c.code, c.id)
		}
	}
	// Still serving: the handshake and a tool list.
	send(`{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}`)
	if a := next("initialize"); a.Error != nil || string(a.ID) != "1" || len(a.Result) == 0 {
		t.Fatalf("initialize after malformed lines: id %s, error %+v", a.ID, a.Error)
	}
	send(`{"jsonrpc":"2.0","method":"notifications/initialized"}`)
	send(`{broken`)
	if a := next("a broken line after the handshake"); a.Error == nil || a.Error.Code != codeParseError {
		t.Fatalf("answer to a broken line: %+v", a)
	}
	send(`{"jsonrpc":"2.0","id":2,"method":"tools/list"}`)
	if a := next("tools/list"); a.Error != nil || string(a.ID) != "2" || !strings.Contains(string(a.Result), `"exec"`) {
		t.Fatalf("tools/list after malformed lines: id %s, error %+v", a.ID, a.Error)
	}
}

// TestConfinedServerRefusesAnotherCheckout: a server started inside a
// checkout serves that checkout only: a cwd in another checkout (or in
// none), a runId of another checkout's sandbox and stop all=true are
// refused before reaching the daemon, and list shows this checkout's
// sandboxes only. --any-checkout lifts it.
func TestConfinedServerRefusesAnotherCheckout(t *testing.T) {
	base, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	mine, other := filepath.Join(base, "mine"), filepath.Join(base, "other")
	for _, d := range []string{filepath.Join(mine, ".git"), filepath.Join(mine, "sub"), filepath.Join(other, ".git"), filepath.Join(base, "plain")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	srv := ipctest.Start(t, ipctest.Options{})
	srv.Sessions.ListFn = func(context.Context, ipc.ListRequest) (ipc.ListResponse, error) {
		return ipc.ListResponse{Sessions: []ipc.SessionInfo{
			{RunID: "run-mine", RepoRoot: mine}, {RunID: "run-other", RepoRoot: other},
		}}, nil
	}
	cs := connect(t, srv, filepath.Join(mine, "sub"))

	for _, args := range []map[string]any{
		{"cwd": other}, {"cwd": filepath.Join(base, "plain")}, {"cwd": "../../other"}, {"runId": "run-other"}, {"runId": "run-unknown"},
	} {
		res, _ := call(t, cs, "status", args)
		if !res.IsError || !strings.Contains(text(res), "outside the checkout "+mine) {
			t.Errorf("status %v: error=%v %s; want a refusal naming %s", args, res.IsError, text(res), mine)
		}
		res, _ = call(t, cs, "exec", mergeArgs(args, map[string]any{"command": "true"}))
		if !res.IsError || !strings.Contains(text(res), "outside the checkout") {
			t.Errorf("exec %v: error=%v %s", args, res.IsError, text(res))
		}
	}
	res, _ := call(t, cs, "stop", map[string]any{"all": true})
	if !res.IsError || !strings.Contains(text(res), "outside the checkout") {
		t.Errorf("stop all: error=%v %s", res.IsError, text(res))
	}
	for _, r := range srv.Sessions.Requests() {
		switch r := r.(type) {
		case ipc.StatusRequest, ipc.StopRequest, ipc.ExecRequest:
			t.Errorf("a refused call reached the daemon: %+v", r)
		}
	}
	for _, args := range []map[string]any{nil, {"cwd": mine}, {"runId": "run-mine"}} {
		if res, _ := call(t, cs, "status", args); res.IsError {
			t.Errorf("status %v in the checkout: %s", args, text(res))
		}
	}
	_, out := call(t, cs, "list", nil)
	if ss, _ := out["sessions"].([]any); len(ss) != 1 || ss[0].(map[string]any)["runId"] != "run-mine" {
		t.Errorf("list of a confined server: %v", out["sessions"])
	}

	// Explicitly unconfined.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	h := &handlers{opts: Options{Dir: mine, AnyCheckout: true}}
	h.confined = confinement(h.opts)
	if _, err := h.target(ctx, Where{Cwd: other}); err != nil {
		t.Errorf("--any-checkout refused %s: %v", other, err)
	}
	if got := confinement(Options{Dir: filepath.Join(base, "plain")}); got != "" {
		t.Errorf("a server started outside any checkout is confined to %q", got)
	}
	if got := confinement(Options{Dir: filepath.Join(base, "plain"), Checkout: other}); got != other {
		t.Errorf("--checkout %s confines to %q", other, got)
	}
}

func mergeArgs(a, b map[string]any) map[string]any {
	out := map[string]any{}
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		out[k] = v
	}
	return out
}

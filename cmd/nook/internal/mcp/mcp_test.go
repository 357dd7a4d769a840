package mcp

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
	"github.com/sandboxd/sandboxd/ipc/ipctest"
)

// connect serves NewServer in process on the fake daemon srv and connects
// the SDK's client to it.
func connect(t *testing.T, srv *ipctest.Server, dir string) *sdk.ClientSession {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, ct := sdk.NewInMemoryTransports()
	c := client.New(srv.Socket)
	t.Cleanup(c.Close)
	ss, err := NewServer(Options{Client: c, Dir: dir, Version: "test"}).Connect(ctx, st, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ss.Close() })
	cs, err := sdk.NewClient(&sdk.Implementation{Name: "test", Version: "1"}, nil).Connect(ctx, ct, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cs.Close() })
	return cs
}

func call(t *testing.T, cs *sdk.ClientSession, name string, args map[string]any) (*sdk.CallToolResult, map[string]any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := cs.CallTool(ctx, &sdk.CallToolParams{Name: name, Arguments: args})
	if err != nil {
		t.Fatalf("call %s: %v", name, err)
	}
	var out map[string]any
	b, _ := json.Marshal(res.StructuredContent)
	_ = json.Unmarshal(b, &out)
	return res, out
}

func text(res *sdk.CallToolResult) string {
	var b strings.Builder
	for _, c := range res.Content {
		if tc, ok := c.(*sdk.TextContent); ok {
			b.WriteString(tc.Text)
		}
	}
	return b.String()
}

// TestPushTool: the push tool is listed with a schema an agent can fill,
// sends POST /v1/push for the checkout the call names (relative to the
// server's directory, or the server's directory itself), answers with the
// daemon's response, and passes the daemon's error on as a tool error.
func TestPushTool(t *testing.T) {
	srv := ipctest.Start(t, ipctest.Options{})
	srv.Sessions.PushFn = func(_ context.Context, req ipc.PushRequest) (ipc.PushResponse, error) {
		if strings.HasSuffix(req.Cwd, "broken") {
			return ipc.PushResponse{}, errdefs.Invalidf("not a git checkout: run it inside one")
		}
		return ipc.PushResponse{RunID: "run-7", Files: []string{"a.go"}, Bytes: 12, Commits: true, PulledFiles: []string{"gen.txt"}}, nil
	}
	dir := t.TempDir()
	cs := connect(t, srv, dir)

	tools, err := cs.ListTools(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var push *sdk.Tool
	for _, tl := range tools.Tools {
		if tl.Name == "push" {
			push = tl
		}
	}
	if push == nil || !strings.Contains(push.Description, "without running a command") || push.Annotations == nil || push.Annotations.ReadOnlyHint {
		t.Fatalf("push tool: %+v", push)
	}
	schema, _ := json.Marshal(push.InputSchema)
	if !strings.Contains(string(schema), `"cwd"`) || !strings.Contains(string(schema), `"runId"`) {
		t.Fatalf("push schema lacks cwd/runId: %s", schema)
	}

	res, out := call(t, cs, "push", map[string]any{"cwd": "sub"})
	if res.IsError || out["runId"] != "run-7" || out["commits"] != true || out["bytes"] != float64(12) {
		t.Fatalf("push: error=%v %v %s", res.IsError, out, text(res))
	}
	if f, _ := out["files"].([]any); len(f) != 1 || f[0] != "a.go" {
		t.Fatalf("push files: %v", out["files"])
	}
	if !strings.Contains(text(res), "gen.txt") {
		t.Fatalf("push text lacks the files brought back: %s", text(res))
	}
	call(t, cs, "push", nil)

	res, _ = call(t, cs, "push", map[string]any{"cwd": "broken"})
	if !res.IsError || !strings.Contains(text(res), "not a git checkout") {
		t.Fatalf("push error: error=%v %s", res.IsError, text(res))
	}

	var got []string
	for _, r := range srv.Sessions.Requests() {
		if p, ok := r.(ipc.PushRequest); ok {
			got = append(got, p.Cwd)
		}
	}
	want := []string{filepath.Join(dir, "sub"), dir, filepath.Join(dir, "broken")}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("push requests: %q, want %q", got, want)
	}
}

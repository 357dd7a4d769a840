package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"
)

// mcpSession runs `nook mcp` in dir and connects the MCP SDK's own client to
// it over stdio.
func (e *env) mcpSession(t *testing.T, dir string, args ...string) *sdk.ClientSession {
	t.Helper()
	cmd := e.nookCmd(dir, append([]string{"mcp"}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	c := sdk.NewClient(&sdk.Implementation{Name: "e2e", Version: "1"}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cs, err := c.Connect(ctx, &sdk.CommandTransport{Command: cmd}, nil)
	if err != nil {
		t.Fatalf("connect to nook mcp: %v\n%s", err, stderr.String())
	}
	t.Cleanup(func() {
		_ = cs.Close()
		if strings.Contains(stderr.String(), raceReport) {
			t.Errorf("the race detector fired in nook mcp:\n%s", stderr.String())
		}
	})
	return cs
}

// callTool calls a tool and returns its text and structured result.
func callTool(t *testing.T, cs *sdk.ClientSession, name string, args map[string]any) (*sdk.CallToolResult, map[string]any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	res, err := cs.CallTool(ctx, &sdk.CallToolParams{Name: name, Arguments: args})
	if err != nil {
		t.Fatalf("call %s %v: %v", name, args, err)
	}
	var structured map[string]any
	if res.StructuredContent != nil {
		b, _ := json.Marshal(res.StructuredContent)
		_ = json.Unmarshal(b, &structured)
	}
	if _, ok := structured["exitCode"]; ok && name == "exec" {
		// exec's output is in its text only (once).
		structured["stdout"], structured["stderr"] = execStreams(toolText(res))
	}
	return res, structured
}

// execStreams reads stdout and stderr back from exec's text, whose
// sections end with a newline.
func execStreams(text string) (stdout, stderr string) {
	_, rest, ok := strings.Cut(text, "stdout:")
	if !ok {
		return "", ""
	}
	i := strings.LastIndex(rest, "stderr:")
	if i < 0 {
		return "", ""
	}
	section := func(s string) string {
		if s == " (empty)\n" {
			return ""
		}
		return strings.TrimPrefix(s, "\n")
	}
	return section(rest[:i]), section(rest[i+len("stderr:"):])
}

func toolText(res *sdk.CallToolResult) string {
	var b strings.Builder
	for _, c := range res.Content {
		if tc, ok := c.(*sdk.TextContent); ok {
			b.WriteString(tc.Text)
		}
	}
	return b.String()
}

// TestMCPTools drives `nook mcp` with the MCP Go SDK's client against a real
// daemon and localcloud: the tool list, exec (shell line and argv, sync both
// ways, exit code, both streams, truncation), push, status, list and stop, with
// the checkout given per call or taken from the server's directory, and
// bad input answered as a tool error that says what to do.
func TestMCPTools(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	writeFile(t, filepath.Join(e.get("XDG_CONFIG_HOME"), "sandboxd", "config.json"), `{"log_level": "debug"}`)
	d := e.startDaemon()
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", d.logs)
		}
	})
	repo := e.newRepo("mcp", defaultConfig)
	// The server starts outside the checkout: calls name it with cwd.
	cs := e.mcpSession(t, e.root, "--max-output", "2048")

	tools, err := cs.ListTools(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]*sdk.Tool{}
	for _, tl := range tools.Tools {
		names[tl.Name] = tl
	}
	for _, want := range []string{"exec", "push", "status", "list", "start", "stop", "reset", "bg_start", "bg_list", "bg_logs", "bg_restart", "bg_stop"} {
		if tl := names[want]; tl == nil || tl.Description == "" || tl.InputSchema == nil {
			t.Errorf("tool %s is missing or has no description/schema: %+v", want, tl)
		}
	}

	writeFile(t, filepath.Join(repo, "local.txt"), "from the laptop\n")
	res, out := callTool(t, cs, "exec", map[string]any{
		"cwd":     repo,
		"command": "cat local.txt; echo made > remote.txt; echo oops >&2; exit 3",
	})
	if res.IsError || out["exitCode"] != float64(3) || out["stdout"] != "from the laptop\n" || out["stderr"] != "oops\n" {
		t.Fatalf("exec: error=%v %v\n%s", res.IsError, out, toolText(res))
	}
	if got := readFile(t, filepath.Join(repo, "remote.txt")); got != "made\n" {
		t.Fatalf("the sandbox's file did not come back: %q", got)
	}
	if txt := toolText(res); !strings.Contains(txt, "exit code: 3") || !strings.Contains(txt, "remote.txt") {
		t.Fatalf("exec text: %s", txt)
	}

	// argv is passed exactly; a relative cwd is taken from the server's
	// directory.
	rel, _ := filepath.Rel(e.root, repo)
	_, out = callTool(t, cs, "exec", map[string]any{"cwd": rel, "argv": []string{"printf", "%s|", "a b", "$HOME", "*"}, "noSync": true})
	if out["stdout"] != "a b|$HOME|*|\n" || out["exitCode"] != float64(0) { // the text ends each section with a newline
		t.Fatalf("argv exec: %v", out)
	}

	// push syncs without running anything: the next exec without sync
	// sees the file.
	writeFile(t, filepath.Join(repo, "pushed.txt"), "pushed\n")
	res, out = callTool(t, cs, "push", map[string]any{"cwd": repo})
	if files, _ := out["files"].([]any); res.IsError || out["runId"] == "" || len(files) == 0 {
		t.Fatalf("push: error=%v %v\n%s", res.IsError, out, toolText(res))
	}
	_, out = callTool(t, cs, "exec", map[string]any{"cwd": repo, "command": "cat pushed.txt", "noSync": true})
	if out["stdout"] != "pushed\n" {
		t.Fatalf("exec after push: %v", out)
	}

	// Output past the limit keeps its start and end, with a note.
	_, out = callTool(t, cs, "exec", map[string]any{"cwd": repo, "command": "seq 1 5000", "noSync": true})
	so, _ := out["stdout"].(string)
	if out["stdoutTruncated"] != true || !strings.HasPrefix(so, "1\n2\n") || !strings.HasSuffix(so, "4999\n5000\n") ||
		!strings.Contains(so, "bytes omitted") || len(so) > 2048+300 {
		t.Fatalf("truncated stdout (%d bytes): %v", len(so), out["stdoutTruncated"])
	}

	_, out = callTool(t, cs, "status", map[string]any{"cwd": repo})
	if out["probe"] != "connected" {
		t.Fatalf("status: %v", out)
	}
	_, out = callTool(t, cs, "list", nil)
	if ss, _ := out["sessions"].([]any); len(ss) != 1 {
		t.Fatalf("list: %v", out)
	}

	// A background process: started, listed, its output read, stopped.
	res, out = callTool(t, cs, "bg_start", map[string]any{"cwd": repo, "name": "srv", "command": "echo serving; exec sleep 300"})
	if res.IsError || out["status"] != "running" {
		t.Fatalf("bg_start: %v %s", out, toolText(res))
	}
	_, out = callTool(t, cs, "bg_list", map[string]any{"cwd": repo})
	if ps, _ := out["processes"].([]any); len(ps) != 1 {
		t.Fatalf("bg_list: %v", out)
	}
	waitUntil(t, 10*time.Second, "the background process's output", func() bool {
		_, out := callTool(t, cs, "bg_logs", map[string]any{"cwd": repo, "name": "srv"})
		return out["stdout"] == "serving\n"
	})
	_, out = callTool(t, cs, "bg_stop", map[string]any{"cwd": repo, "name": "srv"})
	if out["status"] != "stopped" {
		t.Fatalf("bg_stop: %v", out)
	}

	// Bad input is a tool error (not a protocol error) that says what to do.
	res, _ = callTool(t, cs, "exec", map[string]any{"cwd": repo})
	if !res.IsError || !strings.Contains(toolText(res), "give command") {
		t.Fatalf("exec without a command: error=%v %s", res.IsError, toolText(res))
	}
	res, _ = callTool(t, cs, "exec", map[string]any{"cwd": repo, "command": "true", "argv": []string{"true"}})
	if !res.IsError || !strings.Contains(toolText(res), "not both") {
		t.Fatalf("exec with both: error=%v %s", res.IsError, toolText(res))
	}

	_, out = callTool(t, cs, "stop", map[string]any{"cwd": repo})
	if ss, _ := out["stopped"].([]any); len(ss) != 1 {
		t.Fatalf("stop: %v", out)
	}
	_, out = callTool(t, cs, "status", map[string]any{"cwd": repo})
	if out["probe"] == "connected" {
		t.Fatalf("status after stop: %v", out)
	}
}

// TestMCPExecCancel: cancelling an MCP tools/call (notifications/cancelled)
// stops the remote command, and the sandbox is free for the next call.
func TestMCPExecCancel(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("mcpcancel", defaultConfig)
	cs := e.mcpSession(t, repo)
	evs := e.followEvents("")

	pidFile := filepath.Join(e.root, "remote.pid")
	// The sandbox has its own PID namespace: its $$ is no pid of this
	// machine, so the process is found by a unique argument instead.
	sleepArg := fmt.Sprintf("%d.%06d", 300+os.Getpid()%200, time.Now().UnixNano()%1000000)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		_, err := cs.CallTool(ctx, &sdk.CallToolParams{Name: "exec", Arguments: map[string]any{
			"command": "echo $$ > " + pidFile + "; exec sleep " + sleepArg, "noSync": true,
		}})
		errc <- err
	}()
	evs.waitFor(t, 30*time.Second, "exec.started", eventType("exec.started"))
	waitUntil(t, 10*time.Second, "the remote command to write its pid", func() bool {
		b, err := os.ReadFile(pidFile)
		return err == nil && strings.HasSuffix(string(b), "\n")
	})
	cancel()
	if err := <-errc; err == nil {
		t.Fatal("the cancelled call returned no error")
	}
	evs.waitFor(t, 30*time.Second, "exec.finished", eventType("exec.finished"))
	waitUntil(t, 10*time.Second, "the remote command to end", func() bool {
		return !processWithArg(sleepArg)
	})

	_, out := callTool(t, cs, "exec", map[string]any{"argv": []string{"echo", "next"}, "noSync": true})
	if out["stdout"] != "next\n" {
		t.Fatalf("exec after a cancelled one: %v", out)
	}
}

// TestMCPInspectorCLI: an independent MCP client, the MCP Inspector's CLI
// mode (Node), lists the tools of `nook mcp` and calls exec.
func TestMCPInspectorCLI(t *testing.T) {
	t.Parallel()
	inspector := os.Getenv("NOOK_MCP_INSPECTOR")
	if inspector == "" {
		if p, err := exec.LookPath("mcp-inspector"); err == nil {
			inspector = p
		}
	}
	if inspector == "" {
		// Where .ci/run installs it.
		cache, _ := os.UserCacheDir()
		p := filepath.Join(cache, "sandboxd-ci", "mcp-inspector", "node_modules", ".bin", "mcp-inspector")
		if _, err := os.Stat(p); err == nil {
			inspector = p
		}
	}
	if inspector == "" {
		missingTool(t, "mcp-inspector", "npm install -g @modelcontextprotocol/inspector@0.15.0, or set NOOK_MCP_INSPECTOR to its cli.js")
	}
	needTool(t, "node", "apt-get install nodejs npm")
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("inspector", defaultConfig)
	writeFile(t, filepath.Join(repo, "hello.txt"), "synced\n")

	cmd := exec.Command(inspector, "--cli", filepath.Join(binDir, "nook"), "mcp",
		"--method", "tools/call", "--tool-name", "exec", "--tool-arg", "command=cat hello.txt; exit 7")
	cmd.Dir = repo
	cmd.Env = e.vars
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("mcp-inspector: %v\n%s", err, out)
	}
	var res struct {
		StructuredContent struct {
			ExitCode int `json:"exitCode"`
		} `json:"structuredContent"`
		Content []struct {
			Text string `json:"text"`
		} `json:"content"`
		IsError bool `json:"isError"`
	}
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("inspector output is not a tool result: %v\n%s", err, out)
	}
	if res.IsError || res.StructuredContent.ExitCode != 7 || len(res.Content) != 1 || !strings.Contains(res.Content[0].Text, "stdout:\nsynced\n") {
		t.Fatalf("inspector exec: %s", out)
	}
}

package e2e

import (
	"bytes"
	"context"
	"fmt"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"
)

// TestReattachToAHelperThatGoesSilentEndsAtItsBoundAndSaysSo: a held
// command replaces the sandbox helper with one that never answers, then
// its connection drops; the daemon reattaches on a new connection and asks
// the helper about the command. That question says on stderr what it waits
// for past a second, and ends at its bound (the probe timeout plus a
// process's start) with exit 125 and a report, instead of waiting for ever.
func TestReattachToAHelperThatGoesSilentEndsAtItsBoundAndSaysSo(t *testing.T) {
	t.Parallel()
	b := currentSilence()
	e := newEnv(t)
	lc := e.startSilentLocalcloud(b)
	e.writeConfig(map[string]any{"ssh_probe_timeout": b.probeTimeout.String(), "durable_exec": true})
	d := e.startDaemon()
	repo := e.newRepo("silenthelper", defaultConfig)
	e.startServedSandbox(t, repo)
	e.mustNook(repo, "exec", "--", "true")
	counter := counterFile(t, "silenthelper")
	// The running holder keeps its inode; every later start of the helper
	// (the daemon's question) gets the silent one.
	script := fmt.Sprintf(`for f in .git/sandboxd/bin/sandboxd-helper-*; do printf '#!/bin/sh\nexec sleep 120\n' > "$f.new" && chmod 755 "$f.new" && mv -f "$f.new" "$f"; done
echo ran >> %s; sleep 60`, counter)
	cmd := e.nookBackground(repo, "exec", "--no-sync", "--", "sh", "-c", script)
	waitUntil(t, 30*time.Second, "the command to start", func() bool { return strings.Contains(readFileOr(counter), "ran") })
	lc.call(t, "POST", "/admin/silence", map[string]any{"duration_ms": b.silence.Milliseconds(), "drop": true})
	start := time.Now()
	r := cmd.wait(t, 45*time.Second)
	took := time.Since(start)
	if r.code != 125 || !strings.Contains(r.stderr, "the sandbox helper did not answer about the held command within") {
		d.stop(t)
		t.Fatalf("a reattach whose helper never answers: %s\n%s", r, d.logs)
	}
	if !strings.Contains(r.stderr, "waiting for the sandbox helper to answer about the held command since") {
		t.Errorf("no word of the wait for the helper on stderr:\n%s", r.stderr)
	}
	if n := strings.Count(readFileOr(counter), "ran"); n != 1 {
		t.Errorf("the command ran %d times", n)
	}
	t.Logf("a reattach to a silent helper ended %v after the silence began\n%s", took.Round(time.Millisecond), r.stderr)
}

// TestDetachedCommandRunsOnAndAttachGivesItsOutputAndStatus: `nook exec
// --detach` prints the command's id and returns while the command still
// runs in the sandbox (with the local changes pushed first); `nook attach
// ID` gives all its output and exits with its own status, as often as
// asked, without running it again; an unknown id starts nothing.
func TestDetachedCommandRunsOnAndAttachGivesItsOutputAndStatus(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startLocalcloud()
	e.writeConfig(map[string]any{"durable_exec": true})
	d := e.startDaemon()
	repo := e.newRepo("detach", defaultConfig)
	e.startServedSandbox(t, repo)
	writeFile(t, filepath.Join(repo, "local.txt"), "pushed before\n")
	counter := counterFile(t, "detach")
	script := fmt.Sprintf(`echo ran >> %s; cat local.txt; echo err >&2; sleep 3; echo after the detach; echo done >> %s; exit 7`, counter, counter)
	start := time.Now()
	r := e.nook(repo, "exec", "--detach", "--", "sh", "-c", script)
	took := time.Since(start)
	id := strings.TrimSpace(r.stdout)
	if r.code != 0 || !regexp.MustCompile(`^[0-9a-f]{32}$`).MatchString(id) {
		d.stop(t)
		t.Fatalf("nook exec --detach: %s\n%s", r, d.logs)
	}
	if strings.Contains(readFileOr(counter), "done") {
		t.Errorf("nook exec --detach returned after %v, once the command was over: it waited for it", took)
	}
	if !strings.Contains(r.stderr, "nook attach "+id) {
		t.Errorf("nook exec --detach does not say how to follow the command:\n%s", r.stderr)
	}
	for i := 0; i < 2; i++ {
		a := e.nook(repo, "attach", id)
		if a.code != 7 || a.stdout != "pushed before\nafter the detach\n" || !strings.Contains(a.stderr, "err") {
			d.stop(t)
			t.Fatalf("nook attach %s (%d): %s\n%s", id, i+1, a, d.logs)
		}
	}
	if n := strings.Count(readFileOr(counter), "ran"); n != 1 {
		t.Errorf("the detached command ran %d times", n)
	}
	// The sandbox serves synced execs as before.
	if x := e.nook(repo, "exec", "--", "cat", "local.txt"); x.code != 0 || x.stdout != "pushed before\n" {
		t.Errorf("a synced exec after the detached command: %s", x)
	}
	if u := e.nook(repo, "attach", strings.Repeat("0", 32)); u.code == 0 || !strings.Contains(u.stderr, "never started") {
		t.Errorf("nook attach of an unknown id: %s", u)
	}
	t.Logf("nook exec --detach returned in %v", took.Round(time.Millisecond))
}

// TestHeldCommandStopsWhenNookDiesWithoutDetach: with durable exec on, an
// nook exec that is killed (not detached) stops its command, as without the
// holder: only --detach leaves a command running without a caller.
func TestHeldCommandStopsWhenNookDiesWithoutDetach(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startLocalcloud()
	e.writeConfig(map[string]any{"durable_exec": true})
	e.startDaemon()
	repo := e.newRepo("nodetach", defaultConfig)
	e.startServedSandbox(t, repo)
	e.mustNook(repo, "exec", "--", "true")
	counter := counterFile(t, "nodetach")
	cmd := e.nookBackground(repo, "exec", "--no-sync", "--", "sh", "-c", fmt.Sprintf("echo ran >> %s; sleep 3; echo survived >> %s", counter, counter))
	waitUntil(t, 30*time.Second, "the command to start", func() bool { return strings.Contains(readFileOr(counter), "ran") })
	_ = cmd.cmd.Process.Kill()
	cmd.wait(t, 30*time.Second)
	time.Sleep(5 * time.Second)
	if got := readFileOr(counter); strings.Contains(got, "survived") {
		t.Errorf("a held command whose nook was killed ran on:\n%s", got)
	}
}

// TestDetachWithoutTheHelperFailsAtOnceAndRunsNothing: where the sandbox
// helper does not run (sync_helper off), --detach cannot hold the command:
// it fails at once saying why, and the command does not run.
func TestDetachWithoutTheHelperFailsAtOnceAndRunsNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startLocalcloud()
	e.writeConfig(map[string]any{"durable_exec": true, "sync_helper": "off"})
	e.startDaemon()
	repo := e.newRepo("nohelper", defaultConfig)
	e.startSandbox(repo)
	e.mustNook(repo, "exec", "--", "true")
	counter := counterFile(t, "nohelper")
	start := time.Now()
	r := e.nook(repo, "exec", "--detach", "--no-sync", "--", "sh", "-c", "echo ran >> "+counter)
	took := time.Since(start)
	if r.code == 0 || !strings.Contains(r.stderr, "the sandbox helper does not run on this sandbox") || took > 10*time.Second {
		t.Errorf("nook exec --detach without the helper (after %v): %s", took, r)
	}
	if got := readFileOr(counter); got != "" {
		t.Errorf("the command ran: %q", got)
	}
}

// TestMCPExecOnANewCheckoutReportsTheSandboxStartAsProgress: an MCP exec
// call with a progress token on a checkout without a sandbox receives the
// sandbox's start (its phases, as nook prints them on stderr) as
// notifications/progress on that token before its result.
func TestMCPExecOnANewCheckoutReportsTheSandboxStartAsProgress(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("mcpprogress", defaultConfig)
	var mu sync.Mutex
	var msgs []string
	var toks []any
	cmd := e.nookCmd(repo, "mcp")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	c := sdk.NewClient(&sdk.Implementation{Name: "e2e", Version: "1"}, &sdk.ClientOptions{
		ProgressNotificationHandler: func(_ context.Context, req *sdk.ProgressNotificationClientRequest) {
			mu.Lock()
			defer mu.Unlock()
			msgs = append(msgs, req.Params.Message)
			toks = append(toks, req.Params.ProgressToken)
		},
	})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cs, err := c.Connect(ctx, &sdk.CommandTransport{Command: cmd}, nil)
	if err != nil {
		t.Fatalf("connect to nook mcp: %v\n%s", err, stderr.String())
	}
	defer cs.Close()
	params := &sdk.CallToolParams{Name: "exec", Arguments: map[string]any{"command": "echo hi"}}
	params.SetProgressToken("start-1")
	res, err := cs.CallTool(ctx, params)
	if err != nil || res.IsError {
		t.Fatalf("exec: %v %+v", err, res)
	}
	mu.Lock()
	defer mu.Unlock()
	all := strings.Join(msgs, "\n")
	if !strings.Contains(all, "starting a sandbox for") || !strings.Contains(all, "connecting to the sandbox") {
		t.Errorf("progress of the sandbox's start, got:\n%s", all)
	}
	for _, tok := range toks {
		if tok != "start-1" {
			t.Errorf("progress on token %v, want start-1", tok)
		}
	}
	t.Logf("progress:\n%s", all)
}

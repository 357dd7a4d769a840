package mcp

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/backend"
	"github.com/sandboxd/sandboxd/ipc/client"
	"github.com/sandboxd/sandboxd/ipc/ipctest"
)

// progressLog is what an MCP client received as notifications/progress.
type progressLog struct {
	mu   sync.Mutex
	msgs []string
	toks []any
	seen chan string
}

func (l *progressLog) handle(_ context.Context, req *sdk.ProgressNotificationClientRequest) {
	l.mu.Lock()
	l.msgs = append(l.msgs, req.Params.Message)
	l.toks = append(l.toks, req.Params.ProgressToken)
	l.mu.Unlock()
	select {
	case l.seen <- req.Params.Message:
	default:
	}
}

func (l *progressLog) messages() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.msgs...)
}

// connectWithProgress is connect with a client that records progress.
func connectWithProgress(t *testing.T, srv *ipctest.Server, dir string) (*sdk.ClientSession, *progressLog) {
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
	log := &progressLog{seen: make(chan string, 64)}
	cs, err := sdk.NewClient(&sdk.Implementation{Name: "test", Version: "1"}, &sdk.ClientOptions{ProgressNotificationHandler: log.handle}).Connect(ctx, ct, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cs.Close() })
	return cs, log
}

// TestExecWaitsReachTheClientAsProgress: every wait the daemon reports on
// an exec (the queue, the lock held by a silent connection, the handshake,
// the sandbox's start and its phases) reaches an MCP client whose call
// carries a progress token as notifications/progress on that token, in
// nook's words; a call without a token gets none.
func TestExecWaitsReachTheClientAsProgress(t *testing.T) {
	t.Parallel()
	srv := ipctest.Start(t, ipctest.Options{})
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, ".git"), 0o755); err != nil {
		t.Fatal(err)
	}
	cs, log := connectWithProgress(t, srv, dir)
	lockMsg := ipc.WaitingForLock + ", held since 11:14:02 by this machine's connection that went silent"
	connectMsg := ipc.WaitingConnect + " 11:14:03 (the SSH handshake)"
	srv.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st backend.ExecStream) (ipc.ExecResult, error) {
		_ = st.Send(ipc.ExecOutput{Type: ipc.ExecQueued, Position: 2})
		_ = st.Send(ipc.ExecOutput{Type: ipc.ExecQueued, Message: lockMsg})
		_ = st.Send(ipc.ExecOutput{Type: ipc.ExecQueued, Message: connectMsg})
		_ = st.Send(ipc.ExecOutput{Type: ipc.ExecQueued, Message: "starting the sandbox"})
		data, _ := json.Marshal(ipc.Progress{Phase: ipc.PhaseProvisioning, Message: "installing packages", RepoRoot: realPath(dir)})
		// An event of another checkout is not this call's.
		other, _ := json.Marshal(ipc.Progress{Phase: ipc.PhaseProvisioning, Message: "elsewhere", RepoRoot: "/elsewhere"})
		srv.Events.PublishEvent(ipc.Event{Type: "session.progress", SessionID: "s9", Data: other})
		srv.Events.PublishEvent(ipc.Event{Type: "session.progress", SessionID: "s1", RunID: "run-1", Data: data})
		// The phase is relayed while the exec still waits.
		deadline := time.After(5 * time.Second)
		for {
			select {
			case m := <-log.seen:
				if strings.Contains(m, "installing packages") {
					_ = st.Send(ipc.ExecOutput{Type: ipc.ExecStarted})
					return ipc.ExecResult{RunID: "run-1"}, nil
				}
			case <-deadline:
				return ipc.ExecResult{RunID: "run-1", ExitCode: 1}, nil
			case <-ctx.Done():
				return ipc.ExecResult{}, ctx.Err()
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	params := &sdk.CallToolParams{Name: "exec", Arguments: map[string]any{"command": "true"}}
	params.SetProgressToken("tok-1")
	res, err := cs.CallTool(ctx, params)
	if err != nil || res.IsError {
		t.Fatalf("exec: %v %s", err, text(res))
	}
	got := log.messages()
	want := []string{"waiting for the sandbox (2 ahead in its queue) since ", lockMsg, connectMsg, "starting the sandbox", "the sandbox is being set up: installing packages"}
	if len(got) != len(want) {
		t.Fatalf("progress messages %q, want %d like %q", got, len(want), want)
	}
	for i, w := range want {
		if !strings.HasPrefix(got[i], w) {
			t.Errorf("progress %d is %q, want it to begin %q", i, got[i], w)
		}
	}
	log.mu.Lock()
	for _, tok := range log.toks {
		if tok != "tok-1" {
			t.Errorf("progress on token %v, want tok-1", tok)
		}
	}
	log.mu.Unlock()

	// Without a token: no notifications.
	before := len(log.messages())
	params = &sdk.CallToolParams{Name: "exec", Arguments: map[string]any{"command": "true"}}
	srv.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st backend.ExecStream) (ipc.ExecResult, error) {
		_ = st.Send(ipc.ExecOutput{Type: ipc.ExecQueued, Message: lockMsg})
		return ipc.ExecResult{RunID: "run-1"}, nil
	}
	if _, err := cs.CallTool(ctx, params); err != nil {
		t.Fatal(err)
	}
	if after := log.messages(); len(after) != before {
		t.Errorf("a call without a progress token got progress %q", after[before:])
	}
}

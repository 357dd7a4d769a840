package mcp

import (
	"context"
	"encoding/json"
	"errors"
	"path/filepath"
	"strings"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// followProgress sends the call's progress notifications, when the client
// asked for them (a progressToken): the phases the daemon publishes while
// the sandbox the call names is created or started. stop ends them.
func (h *handlers) followProgress(ctx context.Context, req *sdk.CallToolRequest, t ipc.Target) (stop func()) {
	if req == nil || req.Session == nil || req.Params == nil {
		return func() {}
	}
	token := req.Params.GetProgressToken()
	if token == nil {
		return func() {}
	}
	began := time.Now()
	ctx, cancel := context.WithCancel(ctx)
	var since uint64
	st, err := h.opts.Client.Events(ctx, &since)
	if err != nil {
		cancel()
		return func() {}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer st.Close()
		n := 0
		for {
			ev, err := st.Next()
			if err != nil {
				return
			}
			if ev.Type != "session.progress" || ev.Time.Before(began) {
				continue
			}
			var ph ipc.Progress
			if json.Unmarshal(ev.Data, &ph) != nil || !progressOf(t, ev, ph) {
				continue
			}
			msg := ph.Message
			if msg == "" {
				msg = string(ph.Phase)
			}
			n++
			_ = req.Session.NotifyProgress(ctx, &sdk.ProgressNotificationParams{ProgressToken: token, Message: "sandbox: " + msg, Progress: float64(n)})
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

// progressOf reports whether a progress event is of the sandbox a call
// names: its run, or its checkout.
func progressOf(t ipc.Target, ev ipc.Event, ph ipc.Progress) bool {
	if t.RunID != "" {
		return ev.RunID == t.RunID
	}
	root := filepath.Clean(ph.RepoRoot)
	return ph.RepoRoot != "" && (t.Cwd == root || strings.HasPrefix(t.Cwd, root+string(filepath.Separator)))
}

// callError is the error a tool answers: a call the client cancelled says
// so (not the transport's "context canceled"), and the daemon's hints name
// the tools' arguments rather than sbx's flags.
func callError(ctx context.Context, tool string, err error) error {
	if err == nil {
		return nil
	}
	if ctx.Err() != nil || errdefs.KindOf(err) == errdefs.KindCanceled || errors.Is(err, context.Canceled) || strings.HasSuffix(err.Error(), context.Canceled.Error()) {
		if tool == "exec" {
			return errors.New("cancelled: the call was cancelled, and the command in the sandbox was stopped")
		}
		return errors.New("cancelled: the call was cancelled before it finished")
	}
	return errors.New(toolHints(err.Error()))
}

// toolHints rewrites sbx's flags in a daemon message into the arguments of
// the tools.
func toolHints(msg string) string {
	r := strings.NewReplacer(
		"pass --id RUN", "pass runId",
		"or --id RUN", "or runId",
		"--id RUN", "runId",
		"`sbx start --id ", "the start tool with runId `",
		"`sbx status --id ", "the status tool with runId `",
	)
	return r.Replace(msg)
}

// errorsSaid is the middleware that gives every tool's error answer the
// words of callError.
func errorsSaid(next sdk.MethodHandler) sdk.MethodHandler {
	return func(ctx context.Context, method string, req sdk.Request) (sdk.Result, error) {
		res, err := next(ctx, method, req)
		cr, ok := res.(*sdk.CallToolResult)
		if method != "tools/call" || !ok || cr == nil || !cr.IsError {
			return res, err
		}
		tool := ""
		if r, ok := req.(*sdk.CallToolRequest); ok && r.Params != nil {
			tool = r.Params.Name
		}
		for _, c := range cr.Content {
			if tc, ok := c.(*sdk.TextContent); ok {
				tc.Text = callError(ctx, tool, errors.New(tc.Text)).Error()
			}
		}
		return res, err
	}
}

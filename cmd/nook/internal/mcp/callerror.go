package mcp

import (
	"context"
	"errors"
	"strings"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/sandboxd/sandboxd/errdefs"
)

// callError is the error a tool answers: a call the client cancelled says
// so (not the transport's "context canceled"), and the daemon's hints name
// the tools' arguments rather than nook's flags.
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

// toolHints rewrites nook's flags in a daemon message into the arguments of
// the tools.
func toolHints(msg string) string {
	r := strings.NewReplacer(
		"pass --id RUN", "pass runId",
		"or --id RUN", "or runId",
		"--id RUN", "runId",
		"`nook start --id ", "the start tool with runId `",
		"`nook status --id ", "the status tool with runId `",
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

package cli

import (
	"context"
	"fmt"
	"strconv"

	"github.com/sandboxd/sandboxd/cmd/sbx/internal/mcp"
)

// mcpServe is `sbx mcp`: a Model Context Protocol server on stdin/stdout
// until the client goes away. Nothing else may write to stdout.
func (a *app) mcpServe(ctx context.Context) int {
	dir, err := a.cwd()
	if err != nil {
		return a.fail(err)
	}
	if a.p.strings["dir"] != "" {
		dir = a.p.strings["dir"]
	}
	max := mcp.DefaultMaxOutput
	if s := a.p.strings["max-output"]; s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1024 {
			return a.fail(fmt.Errorf("--max-output %q: give a number of bytes, at least 1024", s))
		}
		max = n
	}
	ctx, stop := a.interruptContext(ctx)
	defer stop()
	err = mcp.Serve(ctx, mcp.Options{
		Client:    a.c,
		Dir:       dir,
		MaxOutput: max,
		Version:   a.sys.Version,
		Ensure: func(ctx context.Context) error {
			return a.call(ctx, func(ctx context.Context) error { _, err := a.c.Version(ctx); return err })
		},
	})
	if err != nil {
		return a.fail(err)
	}
	return ExitOK
}

package cli

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"syscall"

	"github.com/sandboxd/sandboxd/cmd/nook/internal/autostart"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc/client"
)

// MCPBinary is the executable that serves `nook mcp`: the MCP SDK lives there
// and not in nook, whose every start-up would otherwise pay for the SDK's
// package initialisation. nook looks for it next to itself, then on PATH.
const MCPBinary = "nook-mcp"

// MCPOptions are what `nook mcp` hands its server.
type MCPOptions struct {
	Client *client.Client
	// Dir is the checkout a tool call means when it names none.
	Dir string
	// MaxOutput bounds an exec's stdout and stderr (0: the server's default).
	MaxOutput int
	Version   string
	// Ensure starts the daemon when none answers.
	Ensure func(ctx context.Context) error
	// Args is nook's command line (without the program name).
	Args []string
	// Checkout confines the server to the checkout holding this
	// directory (default: the one holding Dir, if any).
	Checkout string
	// AnyCheckout lets the server reach every checkout.
	AnyCheckout bool
}

// mcpServe is `nook mcp`: a Model Context Protocol server on stdin/stdout
// until the client goes away. Nothing else may write to stdout.
func (a *app) mcpServe(ctx context.Context) int {
	dir, err := a.cwd()
	if err != nil {
		return a.fail(err)
	}
	if a.p.strings["dir"] != "" {
		dir = a.p.strings["dir"]
	}
	max := 0
	if s := a.p.strings["max-output"]; s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1024 {
			return a.fail(fmt.Errorf("--max-output %q: give a number of bytes, at least 1024", s))
		}
		max = n
	}
	if a.sys.MCP == nil {
		return a.fail(errdefs.Internal(fmt.Errorf("this nook has no MCP server: run %s (it comes with nook)", MCPBinary)))
	}
	ctx, stop := a.interruptContext(ctx)
	defer stop()
	err = a.sys.MCP(ctx, MCPOptions{
		Client:    a.c,
		Dir:       dir,
		MaxOutput: max,
		Version:   a.sys.Version,
		Ensure: func(ctx context.Context) error {
			return a.call(ctx, func(ctx context.Context) error { _, err := a.c.Version(ctx); return err })
		},
		Args:        a.args,
		Checkout:    a.p.strings["checkout"],
		AnyCheckout: a.p.bools["any-checkout"],
	})
	if err != nil {
		return a.fail(err)
	}
	return ExitOK
}

// execMCP is nook's MCP: it replaces this process with nook-mcp, given the
// same command line, so the agent's stdio, signals and exit status are
// nook-mcp's own.
func execMCP(_ context.Context, o MCPOptions) error {
	bin, err := autostart.FindBinary(MCPBinary)
	if err != nil {
		return errdefs.NotFoundf("nook mcp runs %s, which is neither next to this nook nor on PATH\ninstall it with nook (make install, or the sandboxd package), or build it next to nook: go build -o \"$(dirname \"$(command -v nook)\")\" ./cmd/nook/nook-mcp", MCPBinary)
	}
	if err := syscall.Exec(bin, append([]string{bin}, o.Args...), os.Environ()); err != nil {
		return fmt.Errorf("run %s for nook mcp: %w", bin, err)
	}
	return nil // not reached: the process is nook-mcp now
}

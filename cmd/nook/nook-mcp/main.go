// Command nook-mcp serves `nook mcp`: nook replaces itself with nook-mcp, given
// the same command line, so that the MCP server's dependencies are not
// loaded by every other nook command. It is nook with the MCP server linked
// in; run it through `nook mcp`.
package main

import (
	"context"
	"os"

	"github.com/sandboxd/sandboxd/cmd/nook/internal/cli"
	"github.com/sandboxd/sandboxd/cmd/nook/internal/mcp"
)

// Version is set at build time, as for nook.
var Version string

func main() {
	sys := cli.OS(Version)
	sys.MCP = func(ctx context.Context, o cli.MCPOptions) error {
		return mcp.Serve(ctx, mcp.Options{Client: o.Client, Dir: o.Dir, MaxOutput: o.MaxOutput, Version: o.Version, Ensure: o.Ensure,
			Checkout: o.Checkout, AnyCheckout: o.AnyCheckout})
	}
	os.Exit(cli.Main(context.Background(), os.Args[1:], sys))
}

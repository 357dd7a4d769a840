// Command sbx-mcp serves `sbx mcp`: sbx replaces itself with sbx-mcp, given
// the same command line, so that the MCP server's dependencies are not
// loaded by every other sbx command. It is sbx with the MCP server linked
// in; run it through `sbx mcp`.
package main

import (
	"context"
	"os"

	"github.com/sandboxd/sandboxd/cmd/sbx/internal/cli"
	"github.com/sandboxd/sandboxd/cmd/sbx/internal/mcp"
)

// Version is set at build time, as for sbx.
var Version string

func main() {
	sys := cli.OS(Version)
	sys.MCP = func(ctx context.Context, o cli.MCPOptions) error {
		return mcp.Serve(ctx, mcp.Options{Client: o.Client, Dir: o.Dir, MaxOutput: o.MaxOutput, Version: o.Version, Ensure: o.Ensure,
			Checkout: o.Checkout, AnyCheckout: o.AnyCheckout})
	}
	os.Exit(cli.Main(context.Background(), os.Args[1:], sys))
}

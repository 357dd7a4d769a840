// Command sbx is the thin client of sandboxd: it runs commands in a remote
// sandbox (`sbx exec -- make test`) and manages sandboxes. See `sbx --help`.
package main

import (
	"context"
	"os"

	"github.com/sandboxd/sandboxd/cmd/sbx/internal/cli"
)

// Version is set at build time (-ldflags "-X main.Version=...", as for
// sandboxd); empty means the version recorded by the Go build.
var Version string

func main() {
	os.Exit(cli.Main(context.Background(), os.Args[1:], cli.OS(Version)))
}

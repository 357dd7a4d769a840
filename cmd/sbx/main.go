// Command sbx is the thin client of sandboxd: it runs commands in a remote
// sandbox (`sbx exec -- make test`) and manages sandboxes. See `sbx --help`.
package main

import (
	"context"
	"os"
	"runtime"

	"github.com/sandboxd/sandboxd/cmd/sbx/internal/cli"
)

// Version is set at build time (-ldflags "-X main.Version=...", as for
// sandboxd); empty means the version recorded by the Go build.
var Version string

func main() {
	// sbx relays one request's streams: one P serves it, and the runtime
	// then starts no spinning threads to look for work, CPU that each sbx
	// start would pay.
	runtime.GOMAXPROCS(1)
	os.Exit(cli.Main(context.Background(), os.Args[1:], cli.OS(Version)))
}

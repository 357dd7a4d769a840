// Command nook is the thin client of sandboxd: it runs commands in a remote
// sandbox (`nook exec -- make test`) and manages sandboxes. See `nook --help`.
package main

import (
	"context"
	"os"
	"runtime"

	"github.com/sandboxd/sandboxd/cmd/nook/internal/cli"
)

// Version is set at build time (-ldflags "-X main.Version=...", as for
// sandboxd); empty means the version recorded by the Go build.
var Version string

func main() {
	// nook relays one request's streams: one P serves it, and the runtime
	// then starts no spinning threads to look for work, CPU that each nook
	// start would pay.
	runtime.GOMAXPROCS(1)
	os.Exit(cli.Main(context.Background(), os.Args[1:], cli.OS(Version)))
}

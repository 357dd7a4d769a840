// Command sandboxd-helper is what the daemon installs in a sandbox to sync
// in proportion to what changed: see package sandboxhelper.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/sandboxd/sandboxd/sandboxhelper"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	code := sandboxhelper.Main(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

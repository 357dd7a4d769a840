// Command sandboxd-bench is `make bench`: it starts its own isolated
// sandboxd and sandboxd-localcloud, makes its own repositories and
// sandboxes, runs every exec-performance scenario at 0 and 20 ms RTT, and
// prints a table plus the same as JSON (bench.json beside the binaries
// unless -json names another file). BENCH_QUICK=1 (or -quick) runs a
// small version in under a minute.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/sandboxd/sandboxd/internal/bench"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := bench.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

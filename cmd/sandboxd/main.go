// Command sandboxd is the per-user sandbox daemon. See package daemon for
// its lifecycle and README.md for how to run it.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/sandboxd/sandboxd/daemon"
	"github.com/sandboxd/sandboxd/daemon/paths"
	"github.com/sandboxd/sandboxd/daemon/services"
	"github.com/sandboxd/sandboxd/ipc"
)

// Version is set at build time: -ldflags "-X main.Version=..."; empty means
// the version recorded by the Go build (the same fallback as sbx's).
var Version string

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("sandboxd", flag.ContinueOnError)
	fs.SetOutput(stderr)
	socket := fs.String("socket", "", "serve on this Unix socket path (default $SANDBOXD_SOCKET, else $XDG_RUNTIME_DIR/sandboxd/sandboxd.sock); ignored when socket-activated")
	logLevel := fs.String("log-level", "", "debug, info, warn or error (default: log_level from the config file, else info)")
	version := fs.Bool("version", false, "print the version and exit")
	printSocket := fs.Bool("print-socket", false, "print the socket path sandboxd would serve on and exit")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: sandboxd [flags]\n\nsandboxd is the per-user daemon behind sbx. It runs in the foreground and logs to stderr.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "sandboxd: unexpected argument %q\n", fs.Arg(0))
		fs.Usage()
		return 2
	}
	if Version == "" {
		Version = ipc.BuildVersion()
	}
	switch {
	case *version:
		fmt.Fprintln(stdout, "sandboxd", Version)
		return 0
	case *printSocket:
		layout, err := paths.Resolve(paths.OSEnv)
		if err != nil {
			fmt.Fprintln(stderr, prefixed("sandboxd", err))
			return 1
		}
		if *socket != "" {
			layout.Socket = *socket
		}
		fmt.Fprintln(stdout, layout.Socket)
		return 0
	}

	err := daemon.Run(context.Background(), daemon.Options{
		Version:     Version,
		SocketPath:  *socket,
		LogLevel:    *logLevel,
		LogOutput:   stderr,
		NewServices: services.New,
	})
	if err != nil {
		fmt.Fprintln(stderr, prefixed("sandboxd", err))
		return 1
	}
	return 0
}

// prefixed is "prog: err", naming the program once: an error that starts
// with the program's name already says who speaks.
func prefixed(prog string, err error) string {
	msg := err.Error()
	if strings.HasPrefix(msg, prog+" ") || strings.HasPrefix(msg, prog+":") {
		return msg
	}
	return prog + ": " + msg
}

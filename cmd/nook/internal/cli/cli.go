// Package cli is nook: it parses the command line, gathers the caller's
// context (cwd, stdin, terminal), sends one request to sandboxd, relays the
// answer and turns it into an exit code. It holds no state and no locks.
package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"time"

	"golang.org/x/term"

	"github.com/sandboxd/sandboxd/cmd/nook/internal/autostart"
	"github.com/sandboxd/sandboxd/daemon/paths"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
)

// Exit codes besides the remote command's own status.
const (
	ExitOK         = 0
	ExitFailure    = 125 // nook or the daemon failed before the command ran
	ExitNotRunning = 3   // `nook daemon status`: no daemon (as systemctl status)
	ExitInterrupt  = 130 // the user disconnected with a second Ctrl-C
)

// System is what nook takes from its process: streams, environment, working
// directory, signals and time. Tests pass their own.
type System struct {
	Stdin           io.Reader
	Stdout, Stderr  io.Writer
	StdinIsTerminal bool
	// Terminal is stdin's terminal (nil when stdin is not one), for
	// nook shell and exec -t.
	Terminal         Terminal
	StderrIsTerminal bool
	Env              paths.Env
	Getwd            func() (string, error)
	// Notify and StopNotify are signal.Notify and signal.Stop.
	Notify     func(c chan<- os.Signal, sig ...os.Signal)
	StopNotify func(c chan<- os.Signal)
	Now        func() time.Time
	// Version is nook's own version.
	Version string
	// StartDaemon starts sandboxd in the background; nil disables
	// autostart.
	StartDaemon func(ctx context.Context, l paths.Layout, c *client.Client) error
	// MCP serves `nook mcp`. nook's own replaces the process with nook-mcp
	// (execMCP), the binary that links the MCP server.
	MCP func(ctx context.Context, o MCPOptions) error
}

// OS is the System of the running process.
func OS(version string) System {
	if version == "" {
		version = ipc.BuildVersion()
	}
	var tty Terminal
	if term.IsTerminal(int(os.Stdin.Fd())) {
		tty = osTerminal{fd: int(os.Stdin.Fd())}
	}
	return System{
		Stdin:            os.Stdin,
		Stdout:           os.Stdout,
		Stderr:           os.Stderr,
		StdinIsTerminal:  term.IsTerminal(int(os.Stdin.Fd())),
		Terminal:         tty,
		StderrIsTerminal: term.IsTerminal(int(os.Stderr.Fd())),
		Env:              paths.OSEnv,
		Getwd:            os.Getwd,
		Notify:           signal.Notify,
		StopNotify:       signal.Stop,
		Now:              time.Now,
		Version:          version,
		StartDaemon:      startDaemon,
		MCP:              execMCP,
	}
}

// startDaemon is the production autostart: sandboxd next to nook or on PATH,
// logging to the state directory.
func startDaemon(ctx context.Context, l paths.Layout, c *client.Client) error {
	_, err := autostart.Start(ctx, autostart.Options{
		LogFile: l.LogFile(),
		Ready: func(ctx context.Context) bool {
			ctx, cancel := context.WithTimeout(ctx, time.Second)
			defer cancel()
			_, err := c.Version(ctx)
			return err == nil
		},
	})
	return err
}

// app is one nook invocation.
type app struct {
	sys    System
	root   *command
	p      *parsed
	layout paths.Layout
	c      *client.Client
	prog   *progress // the phases of slow waits, on stderr
	args   []string  // the command line, without the program name
}

// Main runs nook with args (without the program name) and returns its exit
// code.
func Main(ctx context.Context, args []string, sys System) int {
	a := &app{sys: sys, root: root(), args: args}
	p, err := parse(a.root, args)
	a.p = p
	if err != nil {
		return a.usage(err)
	}
	switch {
	case p.help():
		printHelp(sys.Stdout, p.cmd)
		return ExitOK
	case p.cmd.isRoot() && p.bools["version"]:
		p.cmd = a.root.sub("version")
	case p.cmd.isRoot():
		printHelp(sys.Stderr, p.cmd)
		return ExitFailure
	}
	layout, err := paths.Resolve(sys.Env)
	if err != nil {
		return a.fail(err)
	}
	a.layout = layout
	a.prog = a.newProgress()
	a.c = client.New(layout.Socket, client.WithUserAgent("nook/"+sys.Version))
	defer a.c.Close()
	code := p.cmd.run(a, ctx)
	// A warning about the daemon's setup (an unisolated local remote), once
	// per command; --json carries it in the records that have warnings.
	if w := a.c.Warning(); w != "" && !a.p.json() {
		a.warn(w)
	}
	return code
}

// usage prints a usage error (with the command's synopsis) and returns the
// failure exit code; other errors go to fail.
func (a *app) usage(err error) int {
	var ue *usageError
	if !errors.As(err, &ue) {
		return a.fail(err)
	}
	if a.p != nil && a.p.json() {
		return a.fail(err)
	}
	fmt.Fprintf(a.sys.Stderr, "nook: %v\n", err)
	if ue.cmd != nil {
		fmt.Fprintf(a.sys.Stderr, "usage: %s (see `%s`)\n", synopsis(ue.cmd), strings.TrimSpace("nook help "+ue.cmd.path()))
	}
	return ExitFailure
}

// fail prints err and returns the failure exit code. Under --json the error
// is one JSON object on stdout (errorJSON) and nothing goes to stderr.
func (a *app) fail(err error) int {
	if a.p != nil && a.p.json() {
		e := errorRecord(err)
		b, _ := json.Marshal(e)
		fmt.Fprintln(a.sys.Stdout, string(b))
		return ExitFailure
	}
	msg := strings.TrimPrefix(err.Error(), "nook: ")
	if !strings.HasSuffix(msg, "\n") {
		msg += "\n"
	}
	fmt.Fprint(a.sys.Stderr, "nook: "+msg)
	return ExitFailure
}

func (a *app) warn(msg string) {
	fmt.Fprintf(a.sys.Stderr, "nook: warning: %s\n", msg)
}

// printJSON writes v as one line of JSON on stdout.
func (a *app) printJSON(v any) int {
	b, err := json.Marshal(v)
	if err != nil {
		return a.fail(fmt.Errorf("encode the JSON output: %w", err))
	}
	fmt.Fprintln(a.sys.Stdout, string(b))
	return ExitOK
}

// autostartEnabled is false when SANDBOXD_NO_AUTOSTART=1 or there is no way
// to start the daemon.
func (a *app) autostartEnabled() bool {
	v, _ := a.sys.Env("SANDBOXD_NO_AUTOSTART")
	return v != "1" && a.sys.StartDaemon != nil && a.p.cmd.autoStart
}

// call runs one request; when no daemon answers (the request never left)
// it starts one and tries once more.
func (a *app) call(ctx context.Context, f func(ctx context.Context) error) error {
	err := f(ctx)
	if !errors.Is(err, client.ErrDaemonNotRunning) {
		return err
	}
	if !a.autostartEnabled() {
		return fmt.Errorf("%w\nstart it with `sandboxd` (or `systemctl --user start sandboxd.socket`); nook does not start it itself because SANDBOXD_NO_AUTOSTART=1", err)
	}
	a.prog.show(ipc.Progress{Phase: ipc.PhaseDaemonStarting})
	serr := a.sys.StartDaemon(ctx, a.layout, a.c)
	a.prog.done()
	if serr != nil {
		return fmt.Errorf("sandboxd is not running and starting it failed: %w", serr)
	}
	return f(ctx)
}

// cwd is the caller's working directory, sent with every session request.
func (a *app) cwd() (string, error) {
	wd, err := a.sys.Getwd()
	if err != nil {
		return "", fmt.Errorf("find the current directory: %w", err)
	}
	return wd, nil
}

// target is the session the command line names: the cwd, an optional config
// argument and --id.
func (a *app) target() (ipc.Target, error) {
	cwd, err := a.cwd()
	if err != nil {
		return ipc.Target{}, err
	}
	t := ipc.Target{Cwd: cwd, RunID: a.p.strings["id"]}
	if len(a.p.args) > 0 {
		t.ConfigFile = a.p.args[0]
	}
	return t, nil
}

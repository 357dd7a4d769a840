package cli

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
)

// doubleInterrupt is the window in which a second Ctrl-C disconnects
// instead of being forwarded.
const doubleInterrupt = 2 * time.Second

// execJSON is the last record of `nook exec --json` (docs/json.md).
type execJSON struct {
	Type        string   `json:"type"` // "result"
	RunID       string   `json:"runId"`
	ExitCode    int      `json:"exitCode"`
	Signal      string   `json:"signal,omitempty"`
	RunURL      string   `json:"runUrl,omitempty"`
	PulledFiles []string `json:"pulledFiles"`
	DurationMs  int64    `json:"durationMs"`
}

// detachedJSON is the last record of `nook exec --detach --json`.
type detachedJSON struct {
	Type   string `json:"type"` // "detached"
	RunID  string `json:"runId"`
	ExecID string `json:"execId"`
}

// warningJSON is a warning record of `nook exec --json`.
type warningJSON struct {
	Type    string `json:"type"` // "warning"
	Message string `json:"message"`
}

func (a *app) exec(ctx context.Context) int {
	t, err := a.target()
	if err != nil {
		return a.fail(err)
	}
	req := ipc.ExecRequest{Target: t, Argv: a.p.argv, NoSync: a.p.bools["no-sync"], Reset: a.p.bools["reset"], Root: a.p.bools["root"], Detach: a.p.bools["detach"]}
	if req.Detach && (a.p.bools["tty"] || a.p.bools["interactive"]) {
		return a.fail(errdefs.Invalidf("--detach runs the command without a caller: it takes no -t or -i"))
	}
	return a.runExecRequest(ctx, req)
}

// attach is `nook attach ID`: it follows a detached command.
func (a *app) attach(ctx context.Context) int {
	if len(a.p.args) != 1 {
		return a.fail(errdefs.Invalidf("give the id that nook exec --detach printed: nook attach ID"))
	}
	cwd, err := a.cwd()
	if err != nil {
		return a.fail(err)
	}
	return a.runExecRequest(ctx, ipc.ExecRequest{Target: ipc.Target{Cwd: cwd, RunID: a.p.strings["id"]}, Attach: a.p.args[0]})
}

// runExecRequest runs an exec (or an attach) with nook's streams, signals
// and progress, and returns nook's exit code.
func (a *app) runExecRequest(ctx context.Context, req ipc.ExecRequest) int {
	ctx, disconnect := context.WithCancel(ctx)
	defer disconnect()

	fwd := newSignalForwarder(a.sys.Now, disconnect)
	// A terminal session whose terminal hung up has nobody left to talk
	// to: disconnect (the daemon stops the remote command), as ssh does.
	fwd.hupDisconnects = a.p.bools["tty"]
	sigc := make(chan os.Signal, 4)
	a.sys.Notify(sigc, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	defer a.sys.StopNotify(sigc)
	stopFwd := make(chan struct{})
	defer close(stopFwd)
	go fwd.run(sigc, stopFwd)

	// Progress (a sandbox starting, a queue) ends when the command starts.
	began := a.sys.Now()
	var follow sync.Once
	var followMu sync.Mutex
	var queuedSince time.Time // when this exec first waited in the queue
	stopFollow := func() {}
	endProgress := func() {
		followMu.Lock()
		s := stopFollow
		stopFollow = func() {}
		followMu.Unlock()
		s()
		a.prog.done()
	}
	defer endProgress()

	// Under --json, stdout carries only NDJSON records: the output chunks
	// with their stream, warnings, then the result (or an error).
	var records *ndjson
	var jsonOut, jsonErr *streamWriter
	if a.p.json() {
		records = &ndjson{w: a.sys.Stdout}
		jsonOut, jsonErr = &streamWriter{out: records, stream: "stdout"}, &streamWriter{out: records, stream: "stderr"}
	}
	opts := client.ExecOptions{
		Stdout:  a.sys.Stdout,
		Stderr:  a.sys.Stderr,
		Signals: fwd.out,
		OnFrame: func(f ipc.ExecOutput) {
			switch f.Type {
			case ipc.ExecWarning:
				if records != nil {
					_ = records.write(warningJSON{Type: "warning", Message: f.Message})
					return
				}
				a.warn(f.Message)
			case ipc.ExecQueued:
				switch {
				case ipc.IsWaitOnReady(f.Message):
					a.prog.show(ipc.Progress{Message: f.Message})
				case f.Message != "":
					// The sandbox is being started: show its phases,
					// replaying those published since this exec began.
					a.prog.show(ipc.Progress{Message: f.Message})
					follow.Do(func() {
						var zero uint64
						s := a.followProgress(ctx, a.prog, &zero, began)
						followMu.Lock()
						stopFollow = s
						followMu.Unlock()
					})
				case f.Position > 0:
					if queuedSince.IsZero() {
						queuedSince = a.sys.Now()
					}
					a.prog.show(ipc.Progress{Message: fmt.Sprintf("waiting for the sandbox (%d ahead in its queue) since %s", f.Position, queuedSince.Format("15:04:05"))})
				}
			case ipc.ExecStarted:
				fwd.commandStarted()
				endProgress()
			}
		},
	}
	if records != nil {
		opts.Stdout, opts.Stderr = jsonOut, jsonErr
	}
	if (!a.sys.StdinIsTerminal || a.p.bools["interactive"]) && !req.Detach && req.Attach == "" {
		opts.Stdin = a.sys.Stdin
	}
	if a.p.bools["tty"] {
		tty, spec, err := a.startTTY()
		if err != nil {
			return a.fail(err)
		}
		// Every way out of exec (return, panic) restores the terminal.
		defer func() {
			if err := tty.stop(); err != nil {
				a.warn(err.Error())
			}
		}()
		stopWindow := make(chan struct{})
		defer close(stopWindow)
		tty.followWindow(a, stopWindow)
		opts.TTY, opts.Resizes, opts.Stdin = spec, tty.resizes, a.sys.Stdin
		onFrame := opts.OnFrame
		opts.OnFrame = func(f ipc.ExecOutput) {
			onFrame(f) // ends the progress display first
			if f.Type == ipc.ExecStarted {
				if err := tty.raw(); err != nil {
					a.warn("could not put the terminal in raw mode: " + err.Error())
				}
			}
		}
		res, err := a.runExec(ctx, req, opts)
		endProgress()
		if rerr := tty.stop(); rerr != nil {
			a.warn(rerr.Error())
		}
		return a.execDone(res, err, fwd, nil, nil, nil)
	}
	res, err := a.runExec(ctx, req, opts)
	endProgress()
	return a.execDone(res, err, fwd, records, jsonOut, jsonErr)
}

func (a *app) runExec(ctx context.Context, req ipc.ExecRequest, opts client.ExecOptions) (ipc.ExecResult, error) {
	var res ipc.ExecResult
	err := a.call(ctx, func(ctx context.Context) (err error) { res, err = a.c.Exec(ctx, req, opts); return err })
	return res, err
}

// execDone turns an exec's outcome into output and nook's exit code.
func (a *app) execDone(res ipc.ExecResult, err error, fwd *signalForwarder, records *ndjson, jsonOut, jsonErr *streamWriter) int {
	if records != nil {
		_ = jsonOut.flush()
		_ = jsonErr.flush()
	}
	if cancelled, started := fwd.disconnected(); cancelled {
		msg := "disconnected: the command was cancelled"
		if !started {
			msg = "interrupted before the command started: it did not run"
		}
		if records != nil {
			_ = records.write(errorJSON{Type: "error", Code: string(errdefs.KindCanceled), Message: msg, Hint: "before the command starts one Ctrl-C stops waiting; once it runs, one Ctrl-C interrupts the remote command and a second within 2s disconnects"})
			return ExitInterrupt
		}
		fmt.Fprintln(a.sys.Stderr, "nook: "+msg)
		return ExitInterrupt
	}
	if err != nil {
		return a.fail(err)
	}
	if res.ExecID != "" && a.p.bools["detach"] {
		// The id alone on stdout, for scripts: id=$(nook exec --detach -- ...).
		if records != nil {
			_ = records.write(detachedJSON{Type: "detached", RunID: res.RunID, ExecID: res.ExecID})
			return 0
		}
		fmt.Fprintln(a.sys.Stdout, res.ExecID)
		if !a.p.quiet() {
			fmt.Fprintf(a.sys.Stderr, "nook: the command runs on in the sandbox; follow it with: nook attach %s\n", res.ExecID)
		}
		return 0
	}
	// Warnings were printed as their frames arrived; res.Warnings repeats
	// them for callers that only read the result.
	code := ExitCode(res)
	if records != nil {
		_ = jsonOut.flush()
		_ = jsonErr.flush()
		if res.PulledFiles == nil {
			res.PulledFiles = []string{}
		}
		_ = records.write(execJSON{Type: "result", RunID: res.RunID, ExitCode: code, Signal: res.Signal, RunURL: res.RunURL, PulledFiles: res.PulledFiles, DurationMs: res.DurationMs})
	}
	return code
}

// ExitCode is nook's exit code for a finished remote command: its status, or
// 128+n when signal n ended it (as shells report it).
func ExitCode(res ipc.ExecResult) int {
	if res.Signal != "" {
		if n := unix.SignalNum("SIG" + res.Signal); n > 0 {
			return 128 + int(n)
		}
		if res.ExitCode > 128 {
			return res.ExitCode
		}
		return 255 // a signal without a number here
	}
	if res.ExitCode < 0 || res.ExitCode > 255 {
		return 255
	}
	return res.ExitCode
}

// signalForwarder turns the signals nook receives into signal frames; a
// second SIGINT within doubleInterrupt disconnects instead. Before the
// command started there is nothing to signal: any signal disconnects, which
// cancels whatever the daemon is waiting for (a sandbox, the queue, the
// lock), so one Ctrl-C or a SIGTERM ends a wait on a slow or failing remote.
type signalForwarder struct {
	now        func() time.Time
	disconnect func()
	out        chan string
	// hupDisconnects turns SIGHUP into a disconnect (terminal sessions).
	hupDisconnects bool

	mu        sync.Mutex
	lastInt   time.Time
	started   bool
	cancelled bool
}

// commandStarted records that the remote command runs: signals are
// forwarded from now on.
func (f *signalForwarder) commandStarted() {
	f.mu.Lock()
	f.started = true
	f.mu.Unlock()
}

func newSignalForwarder(now func() time.Time, disconnect func()) *signalForwarder {
	return &signalForwarder{now: now, disconnect: disconnect, out: make(chan string, 4)}
}

func (f *signalForwarder) run(in <-chan os.Signal, stop <-chan struct{}) {
	for {
		select {
		case <-stop:
			return
		case s := <-in:
			f.handle(s)
		}
	}
}

// handle forwards one signal, or disconnects on a quick second Ctrl-C.
func (f *signalForwarder) handle(s os.Signal) {
	name := signalName(s)
	if name == "" {
		return
	}
	f.mu.Lock()
	if !f.started || name == "HUP" && f.hupDisconnects {
		f.cancelled = true
		f.mu.Unlock()
		f.disconnect()
		return
	}
	if name == "INT" {
		now := f.now()
		if !f.lastInt.IsZero() && now.Sub(f.lastInt) < doubleInterrupt {
			f.cancelled = true
			f.mu.Unlock()
			f.disconnect()
			return
		}
		f.lastInt = now
	}
	f.mu.Unlock()
	select {
	case f.out <- name:
	default: // the daemon is not taking signals fast enough: drop
	}
}

// disconnected reports whether a signal disconnected, and whether the
// command had started then.
func (f *signalForwarder) disconnected() (cancelled, started bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.cancelled, f.started
}

func signalName(s os.Signal) string {
	switch s {
	case syscall.SIGINT:
		return "INT"
	case syscall.SIGTERM:
		return "TERM"
	case syscall.SIGHUP:
		return "HUP"
	case syscall.SIGQUIT:
		return "QUIT"
	}
	return ""
}

// interruptContext ends ctx on SIGINT or SIGTERM (for following streams).
func (a *app) interruptContext(ctx context.Context) (context.Context, func()) {
	ctx, cancel := context.WithCancel(ctx)
	sigc := make(chan os.Signal, 1)
	a.sys.Notify(sigc, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		select {
		case <-sigc:
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, func() { a.sys.StopNotify(sigc); cancel() }
}

// push syncs the working tree to the sandbox without running a command.
func (a *app) push(ctx context.Context) int {
	t, err := a.target()
	if err != nil {
		return a.fail(err)
	}
	var resp ipc.PushResponse
	if err := a.call(ctx, func(ctx context.Context) (err error) { resp, err = a.c.Push(ctx, t); return err }); err != nil {
		return a.fail(err)
	}
	for _, w := range resp.Warnings {
		a.warn(w)
	}
	if a.p.json() {
		return a.printJSON(resp)
	}
	what := fmt.Sprintf("%d changed file(s)", len(resp.Files))
	if resp.Commits {
		what = "your commits and " + what
	}
	fmt.Fprintf(a.sys.Stdout, "Pushed %s to sandbox %s%s\n", what, resp.RunID, spaced(resp.RunURL))
	if len(resp.PulledFiles) > 0 {
		fmt.Fprintf(a.sys.Stdout, "Brought back first: %s\n", strings.Join(resp.PulledFiles, ", "))
	}
	return ExitOK
}

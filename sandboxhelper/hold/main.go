package hold

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
)

// Exit codes of the hold commands themselves; a command's own exit code
// is what attach and start return once it ended.
const (
	ExitUsage   = 2
	ExitFailed  = 124
	ExitStarted = 123 // start: the id was started before; nothing ran again
)

// RootEnv names a directory that overrides DefaultRoot (tests set it).
const RootEnv = "SANDBOXD_HOLD_ROOT"

// DefaultRoot is where the execs are kept, outside any workspace (a sync
// never carries it): $SANDBOXD_HOLD_ROOT when set, else a directory of
// the user's alone in memory (memRoot) when the sandbox has a fitting
// one, else the user's cache. What is kept is worth no more than the
// processes it tracks, which a reboot ends too, and on a disk each exec's
// entries cost inode allocations on its path (docs/performance.md).
func DefaultRoot() (string, error) {
	if dir := os.Getenv(RootEnv); dir != "" {
		if !filepath.IsAbs(dir) {
			return "", fmt.Errorf("%s=%q is not an absolute path", RootEnv, dir)
		}
		return filepath.Clean(dir), nil
	}
	if dir, ok := memRoot("/dev/shm", "/run/systemd/users", os.Getuid()); ok {
		return filepath.Join(dir, "hold"), nil
	}
	dir, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, "sandboxd", "hold"), nil
}

// Main is `hold start ID -- ARGV...`, `hold relay` (start after start
// on one channel: Options.Relay), `hold launch ID -- ARGV...` (start
// without attaching, stdin empty), `hold attach ID OUT ERR`, `hold
// state ID`, `hold signal ID SIGNAL`, `hold eof ID` (the caller's stdin
// ended) and `hold keep ID` (the keeper; started by start). self is the
// argv that runs this program. start and attach feed their stdin to the
// command's.
func Main(ctx context.Context, self string, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	return MainWith(ctx, Options{Self: self}, args, stdin, stdout, stderr)
}

// SpawnRequest asks the helper's server to run and keep a command
// (Holder.Spawn) as this process would have its keeper do.
type SpawnRequest struct {
	Root string   `json:"root"`
	Argv []string `json:"argv"`
	Env  []string `json:"env"`
	Dir  string   `json:"dir"`
}

// Options of MainWith.
type Options struct {
	// Self is the argv[0] that runs this program (the keeper's).
	Self string
	// Server, when set, asks the helper's server to keep the command of
	// id: nil when it started it. An error wrapping ErrRefused (nothing
	// was asked, or the server refused before running anything) leaves it
	// to a keeper of this process's own; any other, once the exec's
	// directory is not there, is ErrRecordGone.
	Server func(ctx context.Context, id string, req SpawnRequest) error
	// Stream, when set, asks the helper's server to keep the command of
	// id and stream it (Stream.Serve) on c, rd being c's reading side
	// past the answer; start asks it before Server. Its errors are
	// Server's.
	Stream func(ctx context.Context, id string, req SpawnRequest) (c io.WriteCloser, rd io.Reader, err error)
	// Exchange, when set, runs a relay request's exchange (the request's
	// Exchange) in this process, in the relay's dir with its env: the
	// daemon's frames on in, the helper's on out, its messages on log; it
	// returns the verb's exit code. Unset, the relay refuses exchanges.
	Exchange func(ctx context.Context, req RelayRequest, dir string, env []string, in io.Reader, out, log io.Writer) int
}

// Begin starts argv under id once, in dir with env: kept by o.Server when
// it answers, else by a keeper of h's own (h.Env and h.Dir set to env and
// dir). ErrStarted: the id was started before, nothing ran again.
func (o Options) Begin(ctx context.Context, h *Holder, id string, argv, env []string, dir string) error {
	h.Env, h.Dir = env, dir
	if o.Server == nil {
		return h.Start(id, argv)
	}
	d, err := h.dir(id)
	if err != nil {
		return err
	}
	if _, err := os.Stat(d); err == nil {
		return ErrStarted
	}
	// The server's answer is not trusted beyond this: the exec's
	// directory, absent before the question, now exists: the command is
	// kept. It does not: a refusal (nothing ran) leaves the command to a
	// keeper; any other answer may be a command that ran and removed its
	// record, which is never started again.
	serr := o.Server(ctx, id, SpawnRequest{Root: h.Root, Argv: argv, Env: env, Dir: dir})
	if _, err := os.Stat(d); err == nil {
		return nil
	}
	if !errors.Is(serr, ErrRefused) {
		return ErrRecordGone
	}
	err = h.Start(id, argv)
	if errors.Is(err, ErrStarted) {
		return nil // created since the question: this start's one run
	}
	return err
}

// MainWith is Main whose start and launch first ask o.Server to keep the
// command: one process start in the sandbox instead of two.
func MainWith(ctx context.Context, o Options, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	self := o.Self
	usage := func() int {
		fmt.Fprintln(stderr, "usage: hold start ID [--stdin-frames] -- ARGV... | relay | launch ID -- ARGV... | attach ID OUT ERR [--stdin-frames] | state ID | signal ID SIGNAL | eof ID")
		return ExitUsage
	}
	if len(args) == 0 || len(args) < 2 && args[0] != "relay" {
		return usage()
	}
	root, err := DefaultRoot()
	if err != nil {
		fmt.Fprintf(stderr, "hold: %v\n", err)
		return ExitFailed
	}
	h := &Holder{Root: root, Keeper: []string{self, "hold", "keep"}}
	if args[0] == "relay" {
		if len(args) != 1 {
			return usage()
		}
		wd, err := os.Getwd()
		if err != nil {
			fmt.Fprintf(stderr, "hold relay: find the working directory: %v\n", err)
			return ExitFailed
		}
		if err := o.Relay(ctx, h, stdin, stdout, os.Environ(), wd); err != nil {
			fmt.Fprintf(stderr, "hold relay: %v\n", err)
			return ExitFailed
		}
		return 0
	}
	id := args[1]
	fail := func(err error) int {
		if errors.Is(err, context.Canceled) || ctx.Err() != nil {
			// The channel is gone (the attach was cut): nothing to say on
			// what are the command's streams.
			return ExitFailed
		}
		fmt.Fprintf(stderr, "hold %s: %v\n", args[0], err)
		return ExitFailed
	}
	signalFiles := func(sig syscall.Signal) { _ = h.Signal(id, sig) }
	// start and attach live as long as the channel that runs them: a hang-up
	// (the channel or its connection is gone) ends them and leaves the
	// command running; any other signal the client sends goes to the
	// command.
	attached := func(relay func(syscall.Signal)) (context.Context, func()) {
		actx, cancel := context.WithCancel(context.Background())
		sigs := make(chan os.Signal, 4)
		signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGQUIT, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGHUP)
		go func() {
			for {
				select {
				case <-actx.Done():
					return
				case sig := <-sigs:
					if sig == syscall.SIGHUP {
						cancel()
						return
					}
					relay(sig.(syscall.Signal))
				}
			}
		}()
		return actx, func() { signal.Stop(sigs); cancel() }
	}
	switch args[0] {
	case "start":
		// --stdin-frames: stdin comes in frames (FeedFrames), whose empty
		// one is the end of the caller's input.
		framed := len(args) > 2 && args[2] == StdinFrames
		if framed {
			args = append(args[:2:2], args[3:]...)
		}
		if len(args) < 4 || args[2] != "--" {
			return usage()
		}
		wd, err := os.Getwd()
		if err != nil {
			return fail(fmt.Errorf("find the working directory: %w", err))
		}
		sigs := make(chan syscall.Signal, 4)
		actx, stop := attached(func(sig syscall.Signal) {
			select {
			case sigs <- sig:
			default:
			}
		})
		defer stop()
		code, err := o.startHeld(actx, h, id, args[3:], os.Environ(), wd, stdin, framed, sigs, stdout, stderr)
		if err != nil {
			if errors.Is(err, ErrStarted) {
				fmt.Fprintf(stderr, "hold start: %v\n", err)
				return ExitStarted
			}
			return fail(err)
		}
		return code
	case "launch":
		// start for a detached exec: the command runs with an empty
		// stdin and nothing attaches; `attach` follows it later.
		if len(args) < 4 || args[2] != "--" {
			return usage()
		}
		wd, err := os.Getwd()
		if err != nil {
			return fail(fmt.Errorf("find the working directory: %w", err))
		}
		if err := o.Begin(ctx, h, id, args[3:], os.Environ(), wd); err != nil {
			if errors.Is(err, ErrStarted) {
				fmt.Fprintf(stderr, "hold launch: %v\n", err)
				return ExitStarted
			}
			return fail(err)
		}
		if err := h.EOF(id); err != nil {
			return fail(err)
		}
		return 0
	case "attach":
		framed := len(args) == 5 && args[4] == StdinFrames
		if framed {
			args = args[:4]
		}
		if len(args) != 4 {
			return usage()
		}
		out, err1 := strconv.ParseInt(args[2], 10, 64)
		errOff, err2 := strconv.ParseInt(args[3], 10, 64)
		if err1 != nil || err2 != nil || out < 0 || errOff < 0 {
			return usage()
		}
		actx, stop := attached(signalFiles)
		defer stop()
		go func() { _ = h.feed(actx, id, stdin, framed) }()
		code, err := h.Attach(actx, id, out, errOff, stdout, stderr)
		if err != nil {
			return fail(err)
		}
		return code
	case "state":
		s, err := h.State(id)
		if err != nil {
			return fail(err)
		}
		_ = json.NewEncoder(stdout).Encode(s)
		return 0
	case "signal":
		if len(args) != 3 {
			return usage()
		}
		sig, ok := signals[args[2]]
		if !ok {
			return fail(fmt.Errorf("signal %q is not one of INT, TERM, KILL, HUP, QUIT, USR1, USR2", args[2]))
		}
		if err := h.Signal(id, sig); err != nil {
			return fail(err)
		}
		return 0
	case "eof":
		if err := h.EOF(id); err != nil {
			return fail(err)
		}
		return 0
	case "keep":
		if err := h.Keep(id); err != nil {
			return fail(err)
		}
		return 0
	}
	return usage()
}

var signals = map[string]syscall.Signal{"INT": syscall.SIGINT, "TERM": syscall.SIGTERM, "KILL": syscall.SIGKILL, "HUP": syscall.SIGHUP, "QUIT": syscall.SIGQUIT, "USR1": syscall.SIGUSR1, "USR2": syscall.SIGUSR2}

// beginStream starts argv under id once, asking the server for a streamed
// start first: c is nil when the command runs but is not streamed to this
// process (kept by an older server, or by a keeper of its own, or started
// before the answer was lost).
func (o Options) beginStream(ctx context.Context, h *Holder, id string, argv, env []string, wd string) (io.WriteCloser, io.Reader, error) {
	if o.Stream == nil {
		return nil, nil, o.Begin(ctx, h, id, argv, env, wd)
	}
	dir, err := h.dir(id)
	if err != nil {
		return nil, nil, err
	}
	if _, err := os.Stat(dir); err == nil {
		return nil, nil, ErrStarted
	}
	// As in Begin: a streamed "kept" is followed on its stream (a record
	// the command removed is not needed there); a failure is followed from
	// the files when the directory exists; a refusal goes to Begin (an
	// older server that does not stream); anything else may have run.
	c, rd, serr := o.Stream(ctx, id, SpawnRequest{Root: h.Root, Argv: argv, Env: env, Dir: wd})
	if serr == nil {
		return c, rd, nil
	}
	if _, err := os.Stat(dir); err == nil {
		return nil, nil, nil
	}
	if !errors.Is(serr, ErrRefused) {
		return nil, nil, ErrRecordGone
	}
	return nil, nil, o.Begin(ctx, h, id, argv, env, wd)
}

// startHeld is start's work, shared by start and relay: argv under id
// once (streamed by the server, else kept by it or a keeper of its own
// and attached from the files), the caller's stdin to it, sigs to its
// process group, until it ends or ctx does. ErrStarted: nothing ran.
func (o Options) startHeld(ctx context.Context, h *Holder, id string, argv, env []string, wd string, stdin io.Reader, framed bool, sigs <-chan syscall.Signal, stdout, stderr io.Writer) (int, error) {
	c, rd, err := o.beginStream(ctx, h, id, argv, env, wd)
	if err != nil {
		return 0, err
	}
	if c != nil {
		return h.streamed(ctx, id, c, rd, stdin, framed, sigs, stdout, stderr)
	}
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case sig := <-sigs:
				_ = h.Signal(id, sig)
			}
		}
	}()
	go func() { _ = h.feed(ctx, id, stdin, framed) }()
	return h.Attach(ctx, id, 0, 0, stdout, stderr)
}

package cli

import (
	"context"
	"errors"
	"os"
	"sync"
	"syscall"

	"golang.org/x/term"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// Terminal is the caller's terminal on stdin, for nook shell and exec -t.
type Terminal interface {
	// MakeRaw puts the terminal in raw mode (keys reach the remote
	// terminal as bytes: Ctrl-C, Ctrl-D, Ctrl-Z included) and returns
	// what restores it.
	MakeRaw() (restore func() error, err error)
	// Size is the window's columns and rows.
	Size() (cols, rows int, err error)
}

// osTerminal is a terminal file descriptor.
type osTerminal struct{ fd int }

func (t osTerminal) MakeRaw() (func() error, error) {
	st, err := term.MakeRaw(t.fd)
	if err != nil {
		return nil, err
	}
	return func() error { return term.Restore(t.fd, st) }, nil
}

func (t osTerminal) Size() (int, int, error) { return term.GetSize(t.fd) }

// shellScript starts, in the sandbox, the caller's login shell ($1: its
// path, else its name on PATH) where the sandbox has it, else bash, else
// sh, with SHELL naming it. The shell is interactive, not a login shell:
// a login shell reads /etc/profile, which on Debian and others sets PATH
// anew and so drops the sandbox's (toolchains, the config's env). ssh to a
// sandbox opens the same kind of shell.
const shellScript = `for c in "$1" "${1##*/}" bash sh; do
	[ -n "$c" ] || continue
	if p=$(command -v -- "$c" 2>/dev/null) && [ -x "$p" ]; then SHELL=$p; export SHELL; exec "$p" -i; fi
done
echo "nook: the sandbox has no shell (not $1, bash or sh)" >&2; exit 127`

// shellArgv is the remote command of nook shell for the caller's login
// shell (the local $SHELL).
func shellArgv(login string) []string {
	return []string{"sh", "-c", shellScript, "nook-shell", login}
}

// shell is `nook shell`: exec -t of the remote interactive shell.
func (a *app) shell(ctx context.Context) int {
	login, _ := a.sys.Env("SHELL")
	a.p.argv = shellArgv(login)
	a.p.bools["tty"] = true
	return a.exec(ctx)
}

// ttySession is the local side of an exec on a pseudo-terminal: the size
// and its changes, and raw mode while the remote command runs.
type ttySession struct {
	t       Terminal
	resizes chan ipc.WindowSize

	mu      sync.Mutex
	restore func() error
}

// startTTY checks that there is a terminal and describes it for the
// request. The caller must call stop on every path.
func (a *app) startTTY() (*ttySession, *ipc.TTY, error) {
	if a.sys.Terminal == nil {
		return nil, nil, errdefs.Invalidf("a terminal session needs a terminal on stdin: run it from a terminal, or use `nook exec` without -t for a command that reads stdin")
	}
	if a.p.json() {
		return nil, nil, errdefs.Invalidf("--json does not mix with a terminal session (-t, nook shell): its output is a terminal's; drop one of them")
	}
	cols, rows, err := a.sys.Terminal.Size()
	if err != nil {
		cols, rows = 80, 24
	}
	termName, _ := a.sys.Env("TERM")
	if termName == "" {
		termName = "xterm"
	}
	s := &ttySession{t: a.sys.Terminal, resizes: make(chan ipc.WindowSize, 1)}
	return s, &ipc.TTY{Term: termName, WindowSize: ipc.WindowSize{Cols: cols, Rows: rows}}, nil
}

// followWindow sends the terminal's size on each SIGWINCH until stop.
func (s *ttySession) followWindow(a *app, stop <-chan struct{}) {
	winch := make(chan os.Signal, 1)
	a.sys.Notify(winch, syscall.SIGWINCH)
	go func() {
		defer a.sys.StopNotify(winch)
		for {
			select {
			case <-stop:
				return
			case <-winch:
				cols, rows, err := s.t.Size()
				if err != nil {
					continue
				}
				select {
				case <-s.resizes: // replace a size not sent yet
				default:
				}
				s.resizes <- ipc.WindowSize{Cols: cols, Rows: rows}
			}
		}
	}()
}

// raw enters raw mode once (when the remote command starts: until then,
// Ctrl-C on the local terminal still interrupts the sync).
func (s *ttySession) raw() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.restore != nil {
		return nil
	}
	restore, err := s.t.MakeRaw()
	if err != nil {
		return err
	}
	s.restore = restore
	return nil
}

// stop restores the terminal if raw mode was entered; safe to call twice.
func (s *ttySession) stop() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.restore == nil {
		return nil
	}
	err := s.restore()
	s.restore = nil
	if err != nil {
		return errors.Join(errors.New("restore the terminal (run `reset` if it misbehaves)"), err)
	}
	return nil
}

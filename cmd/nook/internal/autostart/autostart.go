// Package autostart starts sandboxd in the background for nook when no daemon
// answers on the socket and no service manager started one.
package autostart

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// DaemonName is the daemon's executable name.
const DaemonName = "sandboxd"

// Options say how to start the daemon and how to tell it is serving.
type Options struct {
	// Daemon is the executable; default: sandboxd next to the running
	// executable, else on PATH.
	Daemon string
	// Args are the daemon's arguments (none by default).
	Args []string
	// Env is the daemon's environment; default os.Environ().
	Env []string
	// LogFile receives the daemon's stdout and stderr, appended.
	LogFile string
	// Ready reports whether the daemon answers on its socket.
	Ready func(ctx context.Context) bool
	// Timeout bounds the wait for Ready (default 10s); PollInterval is the
	// time between tries (default 20ms).
	Timeout, PollInterval time.Duration
}

// Started is a daemon this package started.
type Started struct {
	PID     int
	Daemon  string
	LogFile string
}

// Start runs the daemon detached (own session, stdin from /dev/null, output
// appended to the log file) and waits until it serves. When the daemon exits
// before serving, the error carries what it wrote, not a timeout.
func Start(ctx context.Context, o Options) (Started, error) {
	if o.Ready == nil || o.LogFile == "" {
		return Started{}, errors.New("autostart: Ready and LogFile are required")
	}
	if o.Timeout <= 0 {
		o.Timeout = 10 * time.Second
	}
	if o.PollInterval <= 0 {
		o.PollInterval = 20 * time.Millisecond
	}
	bin := o.Daemon
	if bin == "" {
		var err error
		if bin, err = FindDaemon(); err != nil {
			return Started{}, err
		}
	}
	if err := os.MkdirAll(filepath.Dir(o.LogFile), 0o700); err != nil {
		return Started{}, fmt.Errorf("create the daemon's log directory: %w", err)
	}
	logf, err := os.OpenFile(o.LogFile, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return Started{}, fmt.Errorf("open the daemon's log %s: %w", o.LogFile, err)
	}
	defer logf.Close()
	offset, _ := logf.Seek(0, io.SeekEnd)

	cmd := exec.Command(bin, o.Args...)
	cmd.Env = o.Env
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Stdout, cmd.Stderr = logf, logf // stdin stays nil: /dev/null
	// Its own session: the terminal's Ctrl-C and hangup do not reach it,
	// and it outlives this nook.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return Started{}, fmt.Errorf("start %s: %w", bin, err)
	}
	st := Started{PID: cmd.Process.Pid, Daemon: bin, LogFile: o.LogFile}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()

	deadline := time.NewTimer(o.Timeout)
	defer deadline.Stop()
	tick := time.NewTicker(o.PollInterval)
	defer tick.Stop()
	for {
		if o.Ready(ctx) {
			return st, nil
		}
		select {
		case err := <-exited:
			// Another nook may have started a daemon at the same moment:
			// this one then lost the single-instance lock, and the
			// other serves.
			if o.Ready(ctx) {
				return st, nil
			}
			return st, &ExitedError{Daemon: bin, Err: err, Output: tail(o.LogFile, offset, 20), LogFile: o.LogFile}
		case <-tick.C:
		case <-deadline.C:
			return st, fmt.Errorf("%s (pid %d) did not answer within %s; its log is %s:\n%s", bin, st.PID, o.Timeout, o.LogFile, tail(o.LogFile, offset, 20))
		case <-ctx.Done():
			return st, ctx.Err()
		}
	}
}

// ExitedError is a daemon that exited before serving.
type ExitedError struct {
	Daemon  string
	Err     error  // its exit status
	Output  string // the end of what it wrote
	LogFile string
}

func (e *ExitedError) Error() string {
	out := strings.TrimSpace(e.Output)
	if out == "" {
		out = "(it wrote nothing)"
	}
	return fmt.Sprintf("%s exited before serving (%v):\n%s\n(log: %s)", e.Daemon, e.Err, out, e.LogFile)
}

func (e *ExitedError) Unwrap() error { return e.Err }

// FindDaemon looks for sandboxd next to the running executable (an install
// keeps them together), then on PATH.
func FindDaemon() (string, error) {
	p, err := FindBinary(DaemonName)
	if err != nil {
		return "", fmt.Errorf("cannot start the daemon: %s is neither next to this nook nor on PATH: install it (make install) or start it yourself", DaemonName)
	}
	return p, nil
}

// FindBinary looks for the executable name next to the running executable
// (an install keeps sandboxd's binaries together), then on PATH.
func FindBinary(name string) (string, error) {
	if self, err := os.Executable(); err == nil {
		cand := filepath.Join(filepath.Dir(self), name)
		if st, err := os.Stat(cand); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return cand, nil
		}
	}
	return exec.LookPath(name)
}

// tail returns the last n lines written to path after offset.
func tail(path string, offset int64, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return ""
	}
	b, _ := io.ReadAll(io.LimitReader(f, 1<<20))
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

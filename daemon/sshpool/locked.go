package sshpool

import (
	"context"
	"errors"
	"fmt"
	"io"
)

// Locked runs the commands of one exec on the connection that holds the
// agent lock. When a command could not be sent there (the connection
// broke), Relock takes the lock on a new connection before the one retry:
// a push or a command is never run by a connection without the lock.
type Locked struct {
	Conn   *Conn
	Relock func(ctx context.Context) (*Conn, error)
}

// Exec is Conn.ExecOnce on the connection holding the lock.
func (lc *Locked) Exec(ctx context.Context, command string, stdio Stdio) (ExitStatus, error) {
	st, err := lc.Conn.ExecOnce(ctx, command, stdio)
	if err == nil || !errors.Is(err, ErrNotSent) || ctx.Err() != nil {
		return st, err
	}
	conn, lerr := lc.Relock(ctx)
	if lerr != nil {
		return st, fmt.Errorf("%w; taking the sandbox lock on a new connection failed: %w", err, lerr)
	}
	lc.Conn = conn
	return conn.ExecOnce(ctx, command, stdio)
}

// Run runs a sync script (gitsync.Runner): its status as a shell reports it.
func (lc *Locked) Run(ctx context.Context, command string, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	return lc.RunPreamble(ctx, command, nil, stdin, stdout, stderr)
}

// RunPreamble is Run with the first bytes of stdin sent beside the exec
// request (gitsync.PreambleRunner).
func (lc *Locked) RunPreamble(ctx context.Context, command string, preamble []byte, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	st, err := lc.Exec(ctx, command, Stdio{Preamble: preamble, Stdin: stdin, Stdout: stdout, Stderr: stderr})
	if err != nil {
		return -1, err
	}
	return st.ShellCode(), nil
}

// signalNumbers maps SSH signal names to their numbers, for the 128+n exit
// code convention of shells.
var signalNumbers = map[string]int{
	"HUP": 1, "INT": 2, "QUIT": 3, "ILL": 4, "ABRT": 6, "FPE": 8, "KILL": 9,
	"USR1": 10, "SEGV": 11, "USR2": 12, "PIPE": 13, "ALRM": 14, "TERM": 15,
}

// SignalNumber is the number of the SSH signal name.
func SignalNumber(name string) (int, bool) {
	n, ok := signalNumbers[name]
	return n, ok
}

// ShellCode is the status as a shell reports it: 128+n for signal n, 255
// for a signal it does not know.
func (st ExitStatus) ShellCode() int {
	if st.Signal != "" {
		if n, ok := signalNumbers[st.Signal]; ok {
			return 128 + n
		}
		return 255
	}
	return st.Code
}

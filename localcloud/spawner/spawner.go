// Package spawner runs an isolated sandbox's commands from a long-lived
// process inside it. Entering a sandbox per command (a shell writing
// cgroup.procs, nsenter, setpriv) costs a chain of processes and, on an
// idle machine, an RCU grace period per cgroup move; a process forked by
// one already inside the namespaces and
// cgroups inherits them for nothing. The spawner is that process: started
// once per sandbox through the entering chain (so it has every
// restriction a command has: no capabilities, no_new_privs, the
// sandbox's user), it forks each command on request.
//
// Protocol. The spawner holds one end of a control socket (SOCK_SEQPACKET)
// whose only other holder is localcloud. A command is one datagram on it
// carrying four descriptors (SCM_RIGHTS): a fresh stream socket for that
// command, and the command's stdin, stdout and stderr. On the command's
// socket, frames (a 4-byte big-endian length, then JSON) go both ways:
// localcloud sends the Request, then any signals for the command's process
// group; the spawner answers the pid (or why it could not start the
// command), later how it ended. Closing the command's socket before the end
// was reported abandons the command: the spawner kills its group. The
// commands die with the spawner (parent-death signal), so a command is
// never left without anyone to report its end to.
package spawner

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"syscall"
)

// ErrUnavailable says the spawner did not take the command (none runs, it
// could not be started, or it ended before the request reached it): the
// command was not started and may be run another way.
var ErrUnavailable = errors.New("the sandbox's spawner is not available")

// ErrNoAnswer says the spawner took a command but did not answer in time:
// it is stuck (stopped by a signal, say) and should be replaced. Whether
// the command started is not known; killing the spawner kills it if it
// did.
var ErrNoAnswer = errors.New("the sandbox's spawner did not answer in time")

// Request is one command to start.
type Request struct {
	// Argv is the program and its arguments; a program name without a
	// slash is looked up in Env's PATH.
	Argv []string `json:"argv"`
	// Env is the command's whole environment.
	Env []string `json:"env"`
	// Dir is the directory the command starts in (absolute).
	Dir string `json:"dir"`
	// Terminal: stdin is a terminal, which the command gets as its
	// controlling terminal, leading a new session; otherwise the command
	// leads a new process group in the spawner's session.
	Terminal bool `json:"terminal,omitempty"`
}

// Exit is how a command ended: Signal when a signal killed it, Code
// otherwise.
type Exit struct {
	Code   int
	Signal syscall.Signal
}

// StartError is why the spawner could not start a command; it matches
// its errno (errors.Is(err, syscall.ENOENT) for a program not found).
type StartError struct {
	Errno syscall.Errno
	Msg   string
}

func (e *StartError) Error() string { return e.Msg }

// Unwrap gives the errno, if the spawner sent one.
func (e *StartError) Unwrap() error {
	if e.Errno == 0 {
		return nil
	}
	return e.Errno
}

// Limits of the protocol. A request holds a command line and its
// environment, which the kernel bounds (ARG_MAX) well below maxRequest;
// the spawner's answers are small.
const (
	maxRequest = 8 << 20
	maxAnswer  = 64 << 10
	maxSignal  = 64 // SIGRTMAX on Linux
)

// signalFrame is what localcloud sends after the request.
type signalFrame struct {
	Signal int `json:"signal"`
}

// answer is what the spawner sends: first the pid or Error, then, once it
// ended, Exited with Code or Signal.
type answer struct {
	PID    int    `json:"pid,omitempty"`
	Error  string `json:"error,omitempty"`
	Errno  int    `json:"errno,omitempty"`
	Exited bool   `json:"exited,omitempty"`
	Code   int    `json:"code,omitempty"`
	Signal int    `json:"signal,omitempty"`
}

// errFrameTooLarge marks a frame over the limit of its direction.
var errFrameTooLarge = errors.New("frame too large")

// writeFrame sends v as one frame.
func writeFrame(w io.Writer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	buf := make([]byte, 4, 4+len(b))
	binary.BigEndian.PutUint32(buf, uint32(len(b)))
	_, err = w.Write(append(buf, b...))
	return err
}

// readFrame reads one frame of at most limit bytes into v. io.EOF means
// the other side closed before a frame began.
func readFrame(r io.Reader, limit int, v any) error {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return fmt.Errorf("truncated frame header: %w", err)
		}
		return err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > uint32(limit) {
		return fmt.Errorf("%w: %d bytes, at most %d", errFrameTooLarge, n, limit)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return fmt.Errorf("truncated frame: %w", err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("frame is not the expected JSON: %w", err)
	}
	return nil
}

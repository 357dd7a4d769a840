package spawner

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"syscall"
	"time"
)

// ErrSpawnerEnded is Wait's error when the spawner ended before it
// reported the command's end (the command died with it).
var ErrSpawnerEnded = errors.New("the sandbox's spawner ended while the command ran (the command was killed with it)")

// signalTimeout bounds the write of one signal to the spawner, which
// reads them as they come: a spawner that does not is stuck, and the
// signal fails instead of blocking its sender.
const signalTimeout = 5 * time.Second

// Process is a command the spawner started. Its pid is in the sandbox's
// PID namespace: it is signalled through the spawner, never from here.
type Process struct {
	conn net.Conn
	pid  int
	// spawnerGone is closed once the spawner that started it has ended.
	spawnerGone <-chan struct{}

	wmu  sync.Mutex // one signal frame at a time
	done chan struct{}
	exit Exit
	err  error
	// spawnerSaid is the start of what the spawner wrote to its stderr.
	spawnerSaid func() string

	closeOnce sync.Once
}

func newProcess(conn net.Conn, pid int, spawnerGone <-chan struct{}, spawnerSaid func() string) *Process {
	p := &Process{conn: conn, pid: pid, spawnerGone: spawnerGone, spawnerSaid: spawnerSaid, done: make(chan struct{})}
	go p.readEnd()
	return p
}

// Pid is the command's pid in the sandbox's PID namespace.
func (p *Process) Pid() int { return p.pid }

// readEnd reads the one answer the spawner sends after the pid: how the
// command ended. What the spawner says is checked, not trusted: it runs
// inside the sandbox.
func (p *Process) readEnd() {
	defer close(p.done)
	var a answer
	err := readFrame(p.conn, maxAnswer, &a)
	switch {
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET):
		p.err = ErrSpawnerEnded
		// Its sockets close one by one as it dies: once it is gone, the
		// caller's next command finds it so (and starts another) instead
		// of reaching its control socket a moment before that closes.
		select {
		case <-p.spawnerGone:
			// Why, when it said (a Go runtime's abort, say).
			if why, _, _ := strings.Cut(strings.TrimSpace(p.spawnerSaid()), "\n"); why != "" {
				p.err = fmt.Errorf("%w: it said %q", ErrSpawnerEnded, why)
			}
		case <-time.After(2 * time.Second):
		}
	case errors.Is(err, net.ErrClosed):
		p.err = errors.New("the command was abandoned before it ended")
	case err != nil:
		p.err = fmt.Errorf("read the command's end from the sandbox's spawner: %w", err)
	case !a.Exited || a.PID != 0 || a.Error != "":
		p.err = fmt.Errorf("the sandbox's spawner answered %+v where the command's end was due", a)
	case a.Signal > 0 && a.Signal <= maxSignal && a.Code == 0:
		p.exit = Exit{Signal: syscall.Signal(a.Signal)}
	case a.Signal == 0 && a.Code >= 0 && a.Code <= 255:
		p.exit = Exit{Code: a.Code}
	default:
		p.err = fmt.Errorf("the sandbox's spawner reported an impossible end: status %d, signal %d", a.Code, a.Signal)
	}
}

// Signal sends sig to the command's process group (its session's, on a
// terminal), through the spawner. After the command ended it still
// reaches what the command left in its group, until Close.
func (p *Process) Signal(sig syscall.Signal) error {
	if sig <= 0 || sig > maxSignal {
		return fmt.Errorf("signal %d is not a signal", sig)
	}
	p.wmu.Lock()
	defer p.wmu.Unlock()
	_ = p.conn.SetWriteDeadline(time.Now().Add(signalTimeout))
	if err := writeFrame(p.conn, signalFrame{Signal: int(sig)}); err != nil {
		return fmt.Errorf("send signal %d through the sandbox's spawner: %w", sig, err)
	}
	return nil
}

// Wait waits for the command to end. An error means its end is not
// known (ErrSpawnerEnded: the spawner died, and the command with it).
func (p *Process) Wait() (Exit, error) {
	<-p.done
	return p.exit, p.err
}

// Done is closed once Wait would return.
func (p *Process) Done() <-chan struct{} { return p.done }

// Close lets the command go: signals no longer reach its group, and one
// still running is killed (nobody would hear of its end).
func (p *Process) Close() error {
	p.closeOnce.Do(func() { p.conn.Close() })
	return nil
}

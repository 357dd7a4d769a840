//go:build linux

package spawner

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Timeouts of localcloud's side.
const (
	// readyTimeout bounds a spawner's start when the caller's context
	// has no deadline.
	readyTimeout = 10 * time.Second
	// startTimeout bounds the spawner's answer to a request likewise: it
	// answers as soon as it forked, so one that does not is stuck.
	startTimeout = 10 * time.Second
)

// Client is localcloud's side of one spawner process.
type Client struct {
	ctrl *net.UnixConn
	cmd  *exec.Cmd
	done chan struct{}
	errs *limitedBuffer

	closeOnce sync.Once
}

// Launch starts a spawner with cmd, a command prepared to run ExePath in
// the sandbox (through the chain that enters it, so that the spawner has
// the restrictions of a command). Launch passes it this program and the
// bootstrap socket, and returns once the spawner said it is ready.
func Launch(ctx context.Context, cmd *exec.Cmd) (*Client, error) {
	exe, err := os.Open("/proc/self/exe")
	if err != nil {
		return nil, fmt.Errorf("open this program to start the sandbox's spawner: %w", err)
	}
	defer exe.Close()
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("start the sandbox's spawner: make its bootstrap socket: %w", err)
	}
	mine, theirs := os.NewFile(uintptr(pair[0]), "spawner-bootstrap"), os.NewFile(uintptr(pair[1]), "spawner-bootstrap")
	defer mine.Close()
	defer theirs.Close()
	cmd.ExtraFiles = []*os.File{exe, theirs} // exeFD, bootstrapFD
	// Nothing of localcloud's environment; one thread for Go code is
	// plenty, and threads count against the sandbox's process limit
	// (GORACE: a race-enabled build would linger a second at exit).
	cmd.Env = []string{envName + "=1", "GOMAXPROCS=1", "GORACE=atexit_sleep_ms=0", "PATH=/usr/bin:/bin"}
	errs := &limitedBuffer{n: 2048}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = nil, nil, errs
	cmd.WaitDelay = time.Second
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	// Its own session, without localcloud's controlling terminal (a
	// terminal's ^C for localcloud is not for it, and nothing in the
	// sandbox may type into it), and dead with localcloud.
	cmd.SysProcAttr.Setpgid = false
	cmd.SysProcAttr.Setsid = true
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the sandbox's spawner: %w", err)
	}
	theirs.Close()
	c := &Client{cmd: cmd, done: make(chan struct{}), errs: errs}
	go func() {
		_ = cmd.Wait()
		close(c.done)
	}()
	ctrl, err := c.ready(ctx, mine)
	if err != nil {
		_ = cmd.Process.Kill()
		<-c.done
		if s := strings.TrimSpace(errs.String()); s != "" {
			err = fmt.Errorf("%w: %s", err, s)
		}
		return nil, fmt.Errorf("start the sandbox's spawner: %w", err)
	}
	c.ctrl = ctrl
	return c, nil
}

// ready reads the spawner's ready datagram from the bootstrap socket: it
// carries the control socket.
func (c *Client) ready(ctx context.Context, boot *os.File) (*net.UnixConn, error) {
	fc, err := net.FileConn(boot)
	if err != nil {
		return nil, err
	}
	defer fc.Close()
	uc := fc.(*net.UnixConn)
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(readyTimeout)
	}
	_ = uc.SetReadDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = uc.SetReadDeadline(time.Now()) })
	defer stop()
	buf := make([]byte, 64)
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, flags, _, err := uc.ReadMsgUnix(buf, oob)
	fds := rights(oob[:oobn])
	switch {
	case err != nil && ctx.Err() != nil:
		closeAll(fds)
		return nil, ctx.Err()
	case err != nil:
		closeAll(fds)
		return nil, fmt.Errorf("wait for it to be ready: %w", err)
	case n == 0 && oobn == 0:
		return nil, errors.New("it ended before it was ready")
	case string(buf[:n]) != "ready" || len(fds) != 1 || flags&unix.MSG_CTRUNC != 0:
		closeAll(fds)
		return nil, fmt.Errorf("it answered %q with %d descriptors instead of being ready", buf[:n], len(fds))
	}
	f := os.NewFile(uintptr(fds[0]), "spawner-control")
	defer f.Close()
	cc, err := net.FileConn(f)
	if err != nil {
		return nil, fmt.Errorf("its control socket: %w", err)
	}
	ctrl, ok := cc.(*net.UnixConn)
	if !ok {
		cc.Close()
		return nil, errors.New("its control socket is not a Unix socket")
	}
	return ctrl, nil
}

// Done is closed once the spawner (and the chain that started it) ended.
func (c *Client) Done() <-chan struct{} { return c.done }

// Spawn starts req with stdio as its stdin, stdout and stderr (for a
// terminal session, the terminal three times). The caller closes its
// copies of stdio when Spawn returns. An error wrapping ErrUnavailable
// means the request never reached a spawner: the command did not start.
func (c *Client) Spawn(ctx context.Context, req Request, stdio [3]*os.File) (*Process, error) {
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("start a command in the sandbox: make its socket: %w", err)
	}
	mine := os.NewFile(uintptr(pair[0]), "spawner-command")
	// Fd puts a descriptor in blocking mode, which the command gets: its
	// stdio is shared with the command, not only copied.
	fds := []int{pair[1], int(stdio[0].Fd()), int(stdio[1].Fd()), int(stdio[2].Fd())}
	rc, err := c.ctrl.SyscallConn()
	if err == nil {
		werr := rc.Write(func(fd uintptr) bool {
			// One try, never blocking: a spawner whose queue is full is
			// stuck, as good as dead.
			err = unix.Sendmsg(int(fd), []byte("spawn"), unix.UnixRights(fds...), nil, unix.MSG_DONTWAIT)
			return true
		})
		if err == nil {
			err = werr
		}
	}
	runtime.KeepAlive(stdio)
	_ = unix.Close(pair[1])
	if err != nil {
		mine.Close()
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	fc, err := net.FileConn(mine)
	mine.Close()
	if err != nil {
		return nil, fmt.Errorf("start a command in the sandbox: %w", err)
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(startTimeout)
	}
	_ = fc.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = fc.SetDeadline(time.Now()) })
	if err := writeFrame(fc, req); err != nil {
		stop()
		fc.Close()
		if ctx.Err() != nil {
			return nil, fmt.Errorf("start a command in the sandbox: %w", ctx.Err())
		}
		// The spawner reads the whole request before it starts anything.
		return nil, fmt.Errorf("%w: send the request: %w", ErrUnavailable, err)
	}
	var a answer
	err = readFrame(fc, maxAnswer, &a)
	stopped := stop()
	switch {
	case err != nil && errors.Is(ctx.Err(), context.Canceled):
		err = fmt.Errorf("start a command in the sandbox: %w", context.Cause(ctx))
	case err != nil && (!stopped || ctx.Err() != nil || errors.Is(err, os.ErrDeadlineExceeded)):
		err = fmt.Errorf("start a command in the sandbox: %w", ErrNoAnswer)
	case err != nil:
		err = fmt.Errorf("start a command in the sandbox: the spawner did not say whether it started it: %w", err)
	case a.Error != "":
		errno := syscall.Errno(a.Errno)
		if a.Errno <= 0 || a.Errno > 4095 {
			errno = 0
		}
		err = &StartError{Errno: errno, Msg: a.Error}
	case a.PID <= 0 || a.Exited:
		err = fmt.Errorf("start a command in the sandbox: the spawner answered %+v instead of a pid", a)
	}
	if err != nil {
		fc.Close() // a command it started after all is killed
		return nil, err
	}
	_ = fc.SetDeadline(time.Time{})
	return newProcess(fc, a.PID, c.done, c.errs.String), nil
}

// Close ends the spawner (its control socket closing ends it, and the
// commands it started with it) and waits for it.
func (c *Client) Close() error {
	c.closeOnce.Do(func() {
		c.ctrl.Close()
		select {
		case <-c.done:
		case <-time.After(5 * time.Second):
			_ = c.cmd.Process.Kill()
			<-c.done
		}
	})
	return nil
}

// Kill ends the spawner at once (it is stuck) and waits for it.
func (c *Client) Kill() {
	c.closeOnce.Do(func() {
		c.ctrl.Close()
		_ = c.cmd.Process.Kill() // the spawner's parent: its parent-death signal kills it
		<-c.done
	})
}

// limitedBuffer keeps the first n bytes written to it.
type limitedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
	n  int
}

func (l *limitedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if room := l.n - l.b.Len(); room > 0 {
		q := p
		if len(q) > room {
			q = q[:room]
		}
		l.b.Write(q)
	}
	return len(p), nil
}

func (l *limitedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

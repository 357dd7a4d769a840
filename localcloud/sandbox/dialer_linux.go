//go:build linux

package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// A process that is not root cannot move a thread into a sandbox's network
// namespace (setns needs CAP_SYS_ADMIN in its own user namespace, and a Go
// process, being multi-threaded, cannot join the sandbox's user namespace).
// Port forwards then go through a dialer: this program re-executed inside
// the sandbox (entered like any command), which connects to the sandbox's
// loopback on request and passes the connected socket back over a Unix
// socket (SCM_RIGHTS). A socket keeps the network namespace it was made in.

// dialerEnv, set to "1", makes any program linking this package serve as a
// sandbox's dialer on descriptor dialerFD (see init).
const (
	dialerEnv = "SANDBOXD_SANDBOX_DIALER"
	dialerFD  = 4 // 3 is the executable, see startDialer
	// dialTimeout bounds one connection attempt inside the sandbox.
	dialTimeout = 10 * time.Second
)

// The re-executed binary serves as the dialer before anything else runs:
// it is whatever binary holds this package (sandboxd-localcloud, a test
// binary), so the hook has to be here rather than in a main.
func init() {
	if os.Getenv(dialerEnv) == "1" {
		os.Exit(serveDialer(os.NewFile(dialerFD, "dialer")))
	}
}

// serveDialer answers dial requests on ctrl until it closes: each request
// is an address and, passed along with it, the socket to answer on.
func serveDialer(ctrl *os.File) int {
	// Not ptrace-able by the sandbox's own processes (same user).
	_ = unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0)
	fc, err := net.FileConn(ctrl)
	if err != nil {
		fmt.Fprintln(os.Stderr, "sandbox dialer:", err)
		return 1
	}
	ctrl.Close()
	uc, ok := fc.(*net.UnixConn)
	if !ok {
		fmt.Fprintln(os.Stderr, "sandbox dialer: descriptor is not a Unix socket")
		return 1
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	buf := make([]byte, 512)
	oob := make([]byte, unix.CmsgSpace(4))
	for {
		n, oobn, _, _, err := uc.ReadMsgUnix(buf, oob)
		if err != nil || (n == 0 && oobn == 0) {
			return 0 // localcloud went away
		}
		fds := rights(oob[:oobn])
		if len(fds) != 1 {
			for _, fd := range fds {
				unix.Close(fd)
			}
			continue
		}
		addr := string(buf[:n])
		wg.Add(1)
		go func() {
			defer wg.Done()
			answerDial(fds[0], addr)
		}()
	}
}

// answerDial connects to addr and sends the socket (or the error) on fd.
func answerDial(fd int, addr string) {
	defer unix.Close(fd)
	c, err := net.DialTimeout("tcp", addr, dialTimeout)
	if err != nil {
		_ = unix.Sendmsg(fd, []byte("error: "+err.Error()), nil, nil, 0)
		return
	}
	defer c.Close()
	f, err := c.(*net.TCPConn).File()
	if err != nil {
		_ = unix.Sendmsg(fd, []byte("error: "+err.Error()), nil, nil, 0)
		return
	}
	defer f.Close()
	_ = unix.Sendmsg(fd, []byte("ok"), unix.UnixRights(int(f.Fd())), nil, 0)
}

func rights(oob []byte) []int {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil
	}
	var fds []int
	for _, m := range msgs {
		if r, err := unix.ParseUnixRights(&m); err == nil {
			fds = append(fds, r...)
		}
	}
	return fds
}

// dialer is the localcloud side of one sandbox's dialer process.
type dialer struct {
	mu   sync.Mutex
	ctrl *os.File // nil until started, or after the process ended
	cmd  *exec.Cmd
	done chan struct{}
	errs *strings.Builder
}

// conn returns the control socket of a running dialer, starting one in
// s if there is none (or the last one ended).
func (d *dialer) conn(ctx context.Context, s *Sandbox) (*os.File, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.ctrl != nil {
		select {
		case <-d.done:
			d.ctrl.Close()
			d.ctrl = nil
		default:
			return d.ctrl, nil
		}
	}
	select {
	case <-s.done:
		return nil, errors.New("the sandbox has ended")
	default:
	}
	exe, err := os.Open("/proc/self/exe")
	if err != nil {
		return nil, fmt.Errorf("open this program to start the sandbox's dialer: %w", err)
	}
	defer exe.Close()
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("start the sandbox's dialer: %w", err)
	}
	mine, theirs := os.NewFile(uintptr(pair[0]), "dialer"), os.NewFile(uintptr(pair[1]), "dialer")
	defer theirs.Close()
	// The executable is reached through its descriptor: its path may not
	// be visible in the sandbox.
	cmd := s.Command(context.Background(), s.spec.Workspace, fmt.Sprintf("/proc/self/fd/%d", dialerFD-1))
	cmd.Env = []string{dialerEnv + "=1", "PATH=/usr/bin:/bin"}
	cmd.ExtraFiles = []*os.File{exe, theirs} // descriptors 3 and 4
	errs := &strings.Builder{}
	cmd.Stderr = &limitedWriter{w: errs, n: 2048}
	cmd.WaitDelay = time.Second
	if err := cmd.Start(); err != nil {
		mine.Close()
		return nil, fmt.Errorf("start the sandbox's dialer: %w", err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	d.ctrl, d.cmd, d.done, d.errs = mine, cmd, done, errs
	return mine, nil
}

// dial asks the sandbox's dialer to connect to addr.
func (d *dialer) dial(ctx context.Context, s *Sandbox, addr string) (net.Conn, error) {
	ctrl, err := d.conn(ctx, s)
	if err != nil {
		return nil, err
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("dial %s in the sandbox: %w", addr, err)
	}
	answer := os.NewFile(uintptr(pair[0]), "dial-answer")
	defer answer.Close()
	err = unix.Sendmsg(int(ctrl.Fd()), []byte(addr), unix.UnixRights(pair[1]), nil, unix.MSG_DONTWAIT)
	unix.Close(pair[1])
	if err != nil {
		return nil, d.failed(fmt.Errorf("dial %s in the sandbox: the dialer is not answering: %w", addr, err))
	}
	ac, err := net.FileConn(answer)
	if err != nil {
		return nil, fmt.Errorf("dial %s in the sandbox: %w", addr, err)
	}
	defer ac.Close()
	uc := ac.(*net.UnixConn)
	stop := context.AfterFunc(ctx, func() { _ = uc.SetReadDeadline(time.Now()) })
	defer stop()
	buf := make([]byte, 512)
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := uc.ReadMsgUnix(buf, oob)
	fds := rights(oob[:oobn])
	switch {
	case err != nil && ctx.Err() != nil:
		closeAll(fds)
		return nil, fmt.Errorf("dial %s in the sandbox: %w", addr, ctx.Err())
	case err != nil && !errors.Is(err, io.EOF):
		closeAll(fds)
		return nil, fmt.Errorf("dial %s in the sandbox: read the dialer's answer: %w", addr, err)
	case n == 0:
		closeAll(fds)
		return nil, d.failed(fmt.Errorf("dial %s in the sandbox: the dialer ended without answering", addr))
	case string(buf[:n]) != "ok" || len(fds) != 1:
		closeAll(fds)
		return nil, fmt.Errorf("dial %s in the sandbox: %s", addr, strings.TrimPrefix(string(buf[:n]), "error: "))
	}
	f := os.NewFile(uintptr(fds[0]), "tcp")
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		return nil, fmt.Errorf("dial %s in the sandbox: %w", addr, err)
	}
	return c, nil
}

// failed adds what the dialer said on stderr, if it ended.
func (d *dialer) failed(err error) error {
	d.mu.Lock()
	done, errs := d.done, d.errs
	d.mu.Unlock()
	if done == nil {
		return err
	}
	select {
	case <-done:
	case <-time.After(time.Second):
		return err
	}
	if s := strings.TrimSpace(errs.String()); s != "" {
		return fmt.Errorf("%w: %s", err, s)
	}
	return err
}

// close ends the dialer (its control socket closing ends it) and waits.
func (d *dialer) close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.ctrl == nil {
		return
	}
	d.ctrl.Close()
	d.ctrl = nil
	select {
	case <-d.done:
	case <-time.After(5 * time.Second):
		_ = d.cmd.Process.Kill()
		<-d.done
	}
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

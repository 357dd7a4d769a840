//go:build linux

package spawner

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// How Launch hands the spawner what it needs: an environment variable
// makes any program linking this package serve as a spawner (see init),
// with this program as descriptor exeFD (what ExePath runs) and the
// bootstrap socket as bootstrapFD.
const (
	envName     = "SANDBOXD_SANDBOX_SPAWNER"
	exeFD       = 3
	bootstrapFD = 4
	// ExePath is the program a launch command runs: this program,
	// through the descriptor Launch passes (its path may not be visible
	// where the spawner runs).
	ExePath = "/proc/self/fd/3"
	// procName is the spawner's name in ps (comm).
	procName = "sandbox-spawner"
)

// Timeouts of the spawner's side: a request is read, and an answer
// written, within ioTimeout (localcloud sends and reads them at once).
const ioTimeout = 10 * time.Second

// The re-executed binary serves as the spawner before anything else runs:
// it is whatever binary holds this package (sandboxd-localcloud, a test
// binary), so the hook has to be here rather than in a main.
func init() {
	if os.Getenv(envName) == "1" {
		os.Exit(serve())
	}
}

// server is the spawner's state: its children not yet reaped.
type server struct {
	mu       sync.Mutex
	children map[int]chan syscall.WaitStatus
}

// serve sets the spawner up, tells localcloud it is ready, and starts
// commands until localcloud closes the control socket.
func serve() int {
	// Not ptrace-able, its descriptors not openable through /proc, by the
	// sandbox's processes (the same user): it holds every command's stdio.
	_ = unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0)
	// Gone with the process that started it (the entering chain's, gone
	// with localcloud); its commands go with it (their own parent-death
	// signal).
	_ = unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(syscall.SIGKILL), 0, 0, 0)
	if name, err := unix.BytePtrFromString(procName); err == nil {
		_ = unix.Prctl(unix.PR_SET_NAME, uintptr(unsafe.Pointer(name)), 0, 0, 0)
	}
	// Commands never see localcloud's executable, nor its terminal, nor
	// anything else this process inherited: only what Go opens (close on
	// exec) and each command's own stdio reach them.
	_ = unix.Close(exeFD)
	closeOnExec()
	_, _ = unix.Setsid()
	_ = os.Chdir("/")
	// Signals a sandbox's processes may send to all of theirs (kill -TERM
	// -1) do not end it. Handled, not ignored: an ignored signal would stay
	// ignored in the commands.
	quiet := make(chan os.Signal, 8)
	signal.Notify(quiet, syscall.SIGHUP, syscall.SIGINT, syscall.SIGTERM, syscall.SIGQUIT, syscall.SIGPIPE,
		syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGALRM, syscall.SIGTSTP, syscall.SIGTTIN, syscall.SIGTTOU)
	go func() {
		for range quiet {
		}
	}()
	reserveThreads(spareThreads)
	s := &server{children: map[int]chan syscall.WaitStatus{}}
	chld := make(chan os.Signal, 1)
	signal.Notify(chld, syscall.SIGCHLD)
	go s.reap(chld)

	// The control socket is made here and its other end sent back, so
	// that nobody else holds this end: the bootstrap descriptor is also
	// held by the entering chain's processes, which would keep it open
	// (and a dead spawner's socket taking requests) a moment longer.
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		fmt.Fprintln(os.Stderr, "sandbox spawner: make the control socket:", err)
		return 1
	}
	err = unix.Sendmsg(bootstrapFD, []byte("ready"), unix.UnixRights(pair[1]), nil, 0)
	_ = unix.Close(pair[1])
	_ = unix.Close(bootstrapFD)
	if err != nil {
		fmt.Fprintln(os.Stderr, "sandbox spawner: say ready:", err)
		return 1
	}
	return s.loop(pair[0])
}

// spareThreads is how many idle threads the spawner makes at start (they
// count against the sandbox's process limit, as its others do).
const spareThreads = 6

// reserveThreads makes n threads that the Go runtime then keeps idle for
// the system calls that block (the control socket's read, a fork): a
// command that fills the sandbox's process limit (a fork bomb) leaves
// the runtime unable to make a thread, and it aborts when it must make
// one, taking every command with it. Each goroutine holds a thread of
// its own until all n do; unlocked, the threads stay in the runtime's
// idle list.
func reserveThreads(n int) {
	var held, release, done sync.WaitGroup
	held.Add(n)
	release.Add(1)
	done.Add(n)
	for range n {
		go func() {
			defer done.Done()
			runtime.LockOSThread()
			held.Done()
			release.Wait()
			runtime.UnlockOSThread()
		}()
	}
	held.Wait()
	release.Done()
	done.Wait()
}

// closeOnExec marks every inherited descriptor but stdio close-on-exec.
func closeOnExec() {
	if unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC) == nil {
		return
	}
	ents, _ := os.ReadDir("/proc/self/fd") // kernels before 5.11
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd > 2 {
			unix.CloseOnExec(fd)
		}
	}
}

// loop reads command datagrams from ctrl (blocking: this is the
// spawner's one job) until localcloud closes it.
func (s *server) loop(ctrl int) int {
	buf := make([]byte, 64)
	// Room for more descriptors than a request has, to tell a wrong
	// count from a right one.
	oob := make([]byte, unix.CmsgSpace(8*4))
	for {
		n, oobn, flags, _, err := unix.Recvmsg(ctrl, buf, oob, unix.MSG_CMSG_CLOEXEC)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "sandbox spawner: read the control socket:", err)
			return 1
		}
		fds := rights(oob[:oobn])
		if n == 0 && oobn == 0 && hungUp(ctrl) {
			return 0 // localcloud went away, or closed the sandbox
		}
		if flags&(unix.MSG_CTRUNC|unix.MSG_TRUNC) != 0 || string(buf[:n]) != "spawn" || len(fds) != 4 {
			// Not a request: dropped, descriptors and all.
			closeAll(fds)
			continue
		}
		go s.handle(fds[0], [3]int{fds[1], fds[2], fds[3]})
	}
}

// hungUp tells an empty datagram from the end of the socket (both read
// as nothing on SOCK_SEQPACKET).
func hungUp(fd int) bool {
	p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN | unix.POLLRDHUP}}
	n, err := unix.Poll(p, 0)
	return err == nil && n == 1 && p[0].Revents&(unix.POLLHUP|unix.POLLRDHUP) != 0
}

// reap collects every ended child on SIGCHLD and hands its status to
// whoever waits for it.
func (s *server) reap(chld <-chan os.Signal) {
	for range chld {
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if errors.Is(err, syscall.EINTR) {
				continue
			}
			if err != nil || pid <= 0 {
				break
			}
			s.mu.Lock()
			if ch, ok := s.children[pid]; ok {
				delete(s.children, pid)
				ch <- ws
			}
			s.mu.Unlock()
		}
	}
}

// handle serves one command on its socket connFD: the request, the
// start, the signals, the end.
func (s *server) handle(connFD int, stdio [3]int) {
	f := os.NewFile(uintptr(connFD), "command")
	fc, err := net.FileConn(f)
	f.Close()
	if err != nil {
		closeAll(stdio[:])
		return // not a socket: nobody to answer
	}
	conn, ok := fc.(*net.UnixConn)
	if !ok {
		fc.Close()
		closeAll(stdio[:])
		return
	}
	defer conn.Close()
	fail := func(err error) {
		a := answer{Error: err.Error()}
		var errno syscall.Errno
		if errors.As(err, &errno) {
			a.Errno = int(errno)
		}
		_ = conn.SetWriteDeadline(time.Now().Add(ioTimeout))
		_ = writeFrame(conn, a)
	}
	_ = conn.SetReadDeadline(time.Now().Add(ioTimeout))
	var req Request
	if err := readFrame(conn, maxRequest, &req); err != nil {
		closeAll(stdio[:])
		fail(fmt.Errorf("read the request: %w", err))
		return
	}
	_ = conn.SetReadDeadline(time.Time{})
	pid, end, err := s.start(req, stdio)
	closeAll(stdio[:]) // the command has its own; EOF and hangups depend on it
	if err != nil {
		fail(err)
		return
	}
	_ = conn.SetWriteDeadline(time.Now().Add(ioTimeout))
	werr := writeFrame(conn, answer{PID: pid})

	// Signals for the group, until localcloud closes the socket (or sends
	// what is not a signal, which ends the conversation the same way).
	gone := make(chan struct{})
	go func() {
		defer close(gone)
		if werr != nil {
			return
		}
		for {
			var sf signalFrame
			if err := readFrame(conn, 256, &sf); err != nil {
				return
			}
			if sf.Signal > 0 && sf.Signal <= maxSignal {
				_ = syscall.Kill(-pid, syscall.Signal(sf.Signal))
			}
		}
	}()
	select {
	case ws := <-end:
		a := answer{Exited: true, Code: ws.ExitStatus()}
		if ws.Signaled() {
			a = answer{Exited: true, Signal: int(ws.Signal())}
		}
		_ = conn.SetWriteDeadline(time.Now().Add(ioTimeout))
		if writeFrame(conn, a) == nil {
			<-gone // what the command left in its group stays signalable
		}
	case <-gone:
		// Abandoned: nobody would hear of its end.
		_ = syscall.Kill(-pid, syscall.SIGKILL)
		<-end
	}
}

// start forks and executes req with stdio as its descriptors 0, 1 and 2.
func (s *server) start(req Request, stdio [3]int) (int, <-chan syscall.WaitStatus, error) {
	if len(req.Argv) == 0 || req.Argv[0] == "" {
		return 0, nil, errors.New("the request has no program to run")
	}
	if !filepath.IsAbs(req.Dir) {
		return 0, nil, fmt.Errorf("the command's directory %q is not absolute", req.Dir)
	}
	path, err := lookPath(req.Argv[0], req.Env)
	if err != nil {
		return 0, nil, err
	}
	attr := &syscall.ProcAttr{
		Dir:   req.Dir,
		Env:   req.Env,
		Files: []uintptr{uintptr(stdio[0]), uintptr(stdio[1]), uintptr(stdio[2])},
		Sys: &syscall.SysProcAttr{
			// A command leads a session of its own (so a group: its
			// signals reach all it started), on a terminal one whose
			// controlling terminal that is, so that job control works
			// inside; otherwise without one.
			Setsid: true, Setctty: req.Terminal, Ctty: 0,
			// It dies with the spawner: nobody would hear of its end.
			Pdeathsig: syscall.SIGKILL,
		},
	}
	end := make(chan syscall.WaitStatus, 1)
	// Registered before reap can look: the child may end at once.
	s.mu.Lock()
	defer s.mu.Unlock()
	pid, err := syscall.ForkExec(path, req.Argv, attr)
	if err != nil {
		return 0, nil, fmt.Errorf("start %s in %s: %w", req.Argv[0], req.Dir, err)
	}
	s.children[pid] = end
	return pid, end, nil
}

// lookPath finds a program named without a slash in env's PATH, as a
// shell would.
func lookPath(name string, env []string) (string, error) {
	if strings.Contains(name, "/") {
		return name, nil
	}
	path := "/usr/local/bin:/usr/bin:/bin"
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			path = v
		}
	}
	for _, dir := range filepath.SplitList(path) {
		if dir == "" {
			dir = "."
		}
		p := filepath.Join(dir, name)
		if unix.Access(p, unix.X_OK) == nil {
			if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() {
				return p, nil
			}
		}
	}
	return "", fmt.Errorf("start %s: %w", name, syscall.ENOENT)
}

// rights are the descriptors passed in a control message.
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

func closeAll(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}

//go:build linux

package spawner

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

// launch starts a spawner as a plain child of the test (no sandbox: what
// is tested here is the spawner itself) and stops it when the test ends.
func launch(t *testing.T) *Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := Launch(ctx, exec.Command(ExePath))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// pipes are a command's stdin, stdout and stderr and the test's ends.
type pipes struct {
	theirs         [3]*os.File
	stdin          *os.File
	stdout, stderr *os.File
}

func newPipes(t *testing.T) *pipes {
	t.Helper()
	p := &pipes{}
	var err error
	var r, w *os.File
	if r, w, err = os.Pipe(); err != nil {
		t.Fatal(err)
	}
	p.theirs[0], p.stdin = r, w
	if r, w, err = os.Pipe(); err != nil {
		t.Fatal(err)
	}
	p.theirs[1], p.stdout = w, r
	if r, w, err = os.Pipe(); err != nil {
		t.Fatal(err)
	}
	p.theirs[2], p.stderr = w, r
	t.Cleanup(func() {
		for _, f := range []*os.File{p.stdin, p.stdout, p.stderr} {
			f.Close()
		}
	})
	return p
}

// spawn starts script under /bin/sh; the test's ends of the command's
// pipes are returned.
func spawn(t *testing.T, c *Client, script string, env ...string) (*Process, *pipes) {
	t.Helper()
	p := newPipes(t)
	proc, err := c.Spawn(context.Background(), Request{Argv: []string{"/bin/sh", "-c", script}, Env: append([]string{"PATH=/usr/bin:/bin"}, env...), Dir: t.TempDir()}, p.theirs)
	for _, f := range p.theirs {
		f.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { proc.Close() })
	return proc, p
}

func wait(t *testing.T, p *Process) (Exit, error) {
	t.Helper()
	select {
	case <-p.Done():
	case <-time.After(20 * time.Second):
		t.Fatal("the command did not end")
	}
	return p.Wait()
}

func TestExitCodesOutputAndEnvironment(t *testing.T) {
	c := launch(t)
	for _, code := range []int{0, 3, 255} {
		p, _ := spawn(t, c, "exit "+strconv.Itoa(code))
		if e, err := wait(t, p); err != nil || e != (Exit{Code: code}) {
			t.Errorf("exit %d: got %+v, %v", code, e, err)
		}
	}
	dir := t.TempDir()
	pp := newPipes(t)
	proc, err := c.Spawn(context.Background(), Request{Argv: []string{"sh", "-c", "pwd; echo \"$GREETING\"; env | sort; echo err >&2"}, Env: []string{"PATH=/usr/bin:/bin", "GREETING=hi there"}, Dir: dir}, pp.theirs)
	for _, f := range pp.theirs {
		f.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	defer proc.Close()
	out, _ := io.ReadAll(pp.stdout)
	errOut, _ := io.ReadAll(pp.stderr)
	if e, err := wait(t, proc); err != nil || e != (Exit{}) {
		t.Fatalf("got %+v, %v", e, err)
	}
	// The environment is the request's, nothing of the spawner's (sh adds
	// PWD and its own few).
	want := dir + "\nhi there\n"
	if !strings.HasPrefix(string(out), want) || strings.Contains(string(out), envName) || strings.Contains(string(out), "GOMAXPROCS") || string(errOut) != "err\n" {
		t.Fatalf("stdout %q (want it to start with %q, without the spawner's variables), stderr %q", out, want, errOut)
	}
}

func TestKilledBySignalIsReported(t *testing.T) {
	c := launch(t)
	p, _ := spawn(t, c, "kill -USR1 $$; sleep 5")
	if e, err := wait(t, p); err != nil || e != (Exit{Signal: syscall.SIGUSR1}) {
		t.Fatalf("got %+v, %v; want killed by USR1", e, err)
	}
}

// A signal sent as soon as the pid is known reaches the command: it leads
// its group by then.
func TestSignalRightAfterStart(t *testing.T) {
	c := launch(t)
	p, _ := spawn(t, c, "exec sleep 30")
	if err := p.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if e, err := wait(t, p); err != nil || e != (Exit{Signal: syscall.SIGTERM}) {
		t.Fatalf("got %+v, %v; want killed by TERM", e, err)
	}
}

// The signal goes to the command's process group: what it started in the
// background dies too, and the group stays signalable after the command
// ended, until Close.
func TestGroupSignalReachesGrandchildren(t *testing.T) {
	c := launch(t)
	p, pp := spawn(t, c, "sleep 300 & echo $!; wait")
	line := make([]byte, 32)
	n, _ := pp.stdout.Read(line)
	bg, err := strconv.Atoi(strings.TrimSpace(string(line[:n])))
	if err != nil {
		t.Fatalf("no pid: %q", line[:n])
	}
	t.Cleanup(func() { syscall.Kill(bg, syscall.SIGKILL) })
	if err := p.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if e, err := wait(t, p); err != nil || e != (Exit{Signal: syscall.SIGTERM}) {
		t.Fatalf("got %+v, %v; want killed by TERM", e, err)
	}
	waitGone(t, bg)

	// Ended, its group lives on in a background child: still reached.
	p, pp = spawn(t, c, "trap '' HUP; sleep 301 & echo $!")
	n, _ = pp.stdout.Read(line)
	bg, err = strconv.Atoi(strings.TrimSpace(string(line[:n])))
	if err != nil {
		t.Fatalf("no pid: %q", line[:n])
	}
	t.Cleanup(func() { syscall.Kill(bg, syscall.SIGKILL) })
	if e, err := wait(t, p); err != nil || e != (Exit{}) {
		t.Fatalf("got %+v, %v", e, err)
	}
	if !alive(bg) {
		t.Fatal("the background child is gone already")
	}
	if err := p.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitGone(t, bg)
}

func TestStdinEOF(t *testing.T) {
	c := launch(t)
	p, pp := spawn(t, c, "wc -c")
	pp.stdin.Write([]byte("hello"))
	pp.stdin.Close()
	out, _ := io.ReadAll(pp.stdout)
	if e, err := wait(t, p); err != nil || e != (Exit{}) || strings.TrimSpace(string(out)) != "5" {
		t.Fatalf("got %+v, %v, %q", e, err, out)
	}
}

// A command's only descriptors are its stdio: none of the spawner's (its
// control socket, the command sockets, other commands' stdio).
func TestNoDescriptorLeaks(t *testing.T) {
	// A descriptor of this process without close-on-exec: the spawner
	// inherits it (as it would one of localcloud's), its commands must not.
	stray, err := unix.Dup(0)
	if err != nil {
		t.Fatal(err)
	}
	c := launch(t)
	unix.Close(stray)
	_, other := spawn(t, c, "sleep 30") // holds another command's stdio open
	_ = other
	p, pp := spawn(t, c, "ls /proc/$$/fd")
	out, _ := io.ReadAll(pp.stdout)
	wait(t, p)
	if got := strings.Fields(string(out)); strings.Join(got, " ") != "0 1 2" {
		t.Fatalf("the command has descriptors %v, want 0 1 2", got)
	}
}

// openPTY allocates a terminal pair on this machine.
func openPTY(t *testing.T) (master, tty *os.File) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		testutil.Unavailable(t, fmt.Sprintf("no pseudo-terminals here: %v", err), "a /dev/ptmx to open")
	}
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	tt, err := os.OpenFile("/dev/pts/"+strconv.Itoa(n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close(); tt.Close() })
	return m, tt
}

// On a terminal the command leads a session whose controlling terminal
// that is: tty names it, the shell is its session's leader, and a shell
// with job control takes the terminal and gives it back.
func TestTerminalSession(t *testing.T) {
	c := launch(t)
	for _, tc := range []struct {
		script string
		code   int
		check  func(string) bool
	}{
		{`tty; echo "sid=$(ps -o sid= -p $$ | tr -d ' ') pid=$$"`, 0, func(out string) bool {
			f := strings.Fields(out)
			return len(f) == 3 && strings.HasPrefix(f[0], "/dev/pts/") && strings.TrimPrefix(f[1], "sid=") == strings.TrimPrefix(f[2], "pid=")
		}},
		{`sh -i -c 'exit 7'`, 7, func(out string) bool { return !strings.Contains(out, "tty process group") }},
	} {
		master, tty := openPTY(t)
		proc, err := c.Spawn(context.Background(), Request{Argv: []string{"/bin/sh", "-c", tc.script}, Env: []string{"PATH=/usr/bin:/bin", "TERM=xterm"}, Dir: "/", Terminal: true}, [3]*os.File{tty, tty, tty})
		tty.Close()
		if err != nil {
			t.Fatal(err)
		}
		out, _ := io.ReadAll(master) // EIO once the terminal hangs up
		e, err := wait(t, proc)
		proc.Close()
		got := strings.ReplaceAll(string(out), "\r", "")
		if err != nil || e != (Exit{Code: tc.code}) || !tc.check(got) {
			t.Errorf("%s: %+v, %v, output %q", tc.script, e, err, got)
		}
	}
}

// A command whose socket is closed before its end was reported is killed:
// nobody would hear of its end.
func TestAbandonedCommandIsKilled(t *testing.T) {
	c := launch(t)
	p, _ := spawn(t, c, "exec sleep 302")
	p.Close()
	waitGone(t, p.Pid())
}

// A spawner killed mid-run: the running command dies with it and its
// caller gets ErrSpawnerEnded; the next request is refused with
// ErrUnavailable (it never reached a spawner: the caller may start
// another or run it another way).
func TestSpawnerKilledMidRun(t *testing.T) {
	c := launch(t)
	p, _ := spawn(t, c, "exec sleep 303")
	if err := c.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if _, err := wait(t, p); !errors.Is(err, ErrSpawnerEnded) {
		t.Fatalf("Wait after the spawner died: %v, want ErrSpawnerEnded", err)
	}
	waitGone(t, p.Pid())
	<-c.Done()
	pp := newPipes(t)
	_, err := c.Spawn(context.Background(), Request{Argv: []string{"/bin/true"}, Dir: "/"}, pp.theirs)
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Spawn on a dead spawner: %v, want ErrUnavailable", err)
	}
}

// A spawner that aborts (as the Go runtime does when it cannot make a
// thread): the caller's error says what it wrote.
func TestSpawnerAbortIsExplained(t *testing.T) {
	c := launch(t)
	p, _ := spawn(t, c, "exec sleep 305")
	if err := c.cmd.Process.Signal(syscall.SIGABRT); err != nil {
		t.Fatal(err)
	}
	_, err := wait(t, p)
	if !errors.Is(err, ErrSpawnerEnded) || !strings.Contains(err.Error(), "SIGABRT") {
		t.Fatalf("Wait after the spawner aborted: %v, want ErrSpawnerEnded saying SIGABRT", err)
	}
}

// Close ends the spawner and what it runs.
func TestCloseEndsSpawnerAndCommands(t *testing.T) {
	c := launch(t)
	p, _ := spawn(t, c, "exec sleep 304")
	c.Close()
	select {
	case <-c.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the spawner did not end")
	}
	waitGone(t, p.Pid())
}

// Input that is not a request, on the control socket or on a command's
// socket, is refused (with an answer where there is a socket to answer
// on) without ending the spawner, which then starts the next command.
func TestHostileInput(t *testing.T) {
	c := launch(t)
	rc, err := c.ctrl.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	send := func(msg []byte, fds ...int) {
		t.Helper()
		var serr error
		if err := rc.Write(func(fd uintptr) bool {
			var oob []byte
			if len(fds) > 0 {
				oob = unix.UnixRights(fds...)
			}
			serr = unix.Sendmsg(int(fd), msg, oob, nil, 0)
			return true
		}); err != nil || serr != nil {
			t.Fatalf("send: %v %v", err, serr)
		}
	}
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devnull.Close()
	null := int(devnull.Fd())
	// On the control socket: garbage, an empty datagram, wrong counts of
	// descriptors, a request whose command socket is not a socket.
	send([]byte("garbage \x00\xff"))
	send(nil)
	send([]byte("spawn"))
	send([]byte("spawn"), null)
	send([]byte("spawn"), null, null, null, null, null)
	send([]byte("spawn"), null, null, null, null)
	send(bytes.Repeat([]byte("x"), 1000), null, null, null, null)

	// On a command's socket: each is answered with an error.
	command := func(write func(net.Conn)) answer {
		t.Helper()
		pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		send([]byte("spawn"), pair[1], null, null, null)
		unix.Close(pair[1])
		f := os.NewFile(uintptr(pair[0]), "command")
		conn, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(20 * time.Second))
		write(conn)
		var a answer
		if err := readFrame(conn, maxAnswer, &a); err != nil {
			t.Fatalf("no answer: %v", err)
		}
		return a
	}
	frame := func(n uint32, body string) []byte {
		b := binary.BigEndian.AppendUint32(nil, n)
		return append(b, body...)
	}
	for name, tc := range map[string]struct {
		write func(net.Conn)
		want  string
		errno syscall.Errno
	}{
		"too large":          {func(c net.Conn) { c.Write(frame(1<<31, "")) }, "too large", 0},
		"truncated header":   {func(c net.Conn) { c.Write([]byte{0, 0}); c.(*net.UnixConn).CloseWrite() }, "truncated", 0},
		"truncated body":     {func(c net.Conn) { c.Write(frame(100, `{"argv"`)); c.(*net.UnixConn).CloseWrite() }, "truncated", 0},
		"not JSON":           {func(c net.Conn) { c.Write(frame(5, "\x00\x01\x02\x03\x04")) }, "JSON", 0},
		"wrong JSON":         {func(c net.Conn) { c.Write(frame(13, `{"argv":"sh"}`)) }, "JSON", 0},
		"no program":         {func(c net.Conn) { writeFrame(c, Request{Dir: "/"}) }, "no program", 0},
		"relative directory": {func(c net.Conn) { writeFrame(c, Request{Argv: []string{"/bin/true"}, Dir: "tmp"}) }, "not absolute", 0},
		"no such directory":  {func(c net.Conn) { writeFrame(c, Request{Argv: []string{"/bin/true"}, Dir: "/nonexistent"}) }, "nonexistent", syscall.ENOENT},
		"no such program":    {func(c net.Conn) { writeFrame(c, Request{Argv: []string{"no-such-program"}, Dir: "/"}) }, "no-such-program", syscall.ENOENT},
		"NUL in argv":        {func(c net.Conn) { writeFrame(c, Request{Argv: []string{"/bin/true", "a\x00b"}, Dir: "/"}) }, "true", syscall.EINVAL},
	} {
		a := command(tc.write)
		if a.PID != 0 || !strings.Contains(a.Error, tc.want) || syscall.Errno(a.Errno) != tc.errno {
			t.Errorf("%s: answered %+v, want an error saying %q (errno %d)", name, a, tc.want, tc.errno)
		}
	}
	// A client that says nothing is given up on, and the spawner lives on.
	select {
	case <-c.Done():
		t.Fatalf("the spawner ended: %s", c.errs.String())
	default:
	}
	p, pp := spawn(t, c, "echo still here")
	out, _ := io.ReadAll(pp.stdout)
	if e, err := wait(t, p); err != nil || e != (Exit{}) || string(out) != "still here\n" {
		t.Fatalf("after hostile input: %+v, %v, %q", e, err, out)
	}
	// The error of a start reaches the caller, with its errno.
	pp = newPipes(t)
	_, err = c.Spawn(context.Background(), Request{Argv: []string{filepath.Join(t.TempDir(), "missing")}, Dir: "/"}, pp.theirs)
	var se *StartError
	if !errors.As(err, &se) || !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("starting a missing program: %v, want a StartError matching ENOENT", err)
	}
}

func alive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && i+2 < len(s) {
		return s[i+2] != 'Z' && s[i+2] != 'X'
	}
	return true
}

func waitGone(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for alive(pid) {
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("process %d still runs", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

package client_test

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
)

// TestMain lets the test binary play an impostor daemon of another user.
func TestMain(m *testing.M) {
	if sock := os.Getenv("NOOK_TEST_IMPOSTOR"); sock != "" {
		os.Exit(impostor(sock))
	}
	os.Exit(m.Run())
}

// impostor listens on sock, says "ready", then reports how many bytes the
// first connection sent before closing.
func impostor(sock string) int {
	ln, err := net.Listen("unix", sock)
	if err != nil {
		fmt.Println("listen:", err)
		return 1
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	fmt.Println("ready")
	c, err := ln.Accept()
	if err != nil {
		return 1
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, _ := c.Read(make([]byte, 512))
	fmt.Println("received", n)
	return 0
}

// listenAndCount serves sock and reports the bytes each connection sent.
func listenAndCount(t *testing.T, sock string) chan int64 {
	t.Helper()
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	got := make(chan int64, 8)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				// The first read tells: EOF when the client hung up
				// without sending, bytes when it sent.
				_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
				n, _ := c.Read(make([]byte, 512))
				got <- int64(n)
			}()
		}
	}()
	return got
}

func TestRefusesASocketDirectoryOthersCanWrite(t *testing.T) {
	dir, err := os.MkdirTemp("", "nook")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "sandboxd.sock")
	got := listenAndCount(t, sock)
	for _, mode := range []os.FileMode{0o777, 0o770, 0o702} {
		if err := os.Chmod(dir, mode); err != nil {
			t.Fatal(err)
		}
		_, err := client.New(sock).Version(ctx(t))
		var ue *client.UntrustedError
		if !errors.As(err, &ue) || !errors.Is(err, errdefs.ErrUnauthorized) || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), "writable by other users") {
			t.Fatalf("directory mode %o: %v", mode, err)
		}
		if n := <-got; n != 0 {
			t.Fatalf("directory mode %o: %d bytes were sent before the check", mode, n)
		}
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	// The same socket in a private directory is trusted (the request then
	// reaches the listener, which does not answer).
	c := client.New(sock)
	go func() { _, _ = c.Version(ctx(t)) }()
	if n := <-got; n == 0 {
		t.Fatal("nothing was sent to a socket in a private directory")
	}
}

// TestRefusesADaemonOfAnotherUser: another user's process serving the
// socket path (it created the path first, in a directory it controls, or
// the socket is in our directory but its peer is someone else) never
// receives a byte. It needs root to run a process as another user.
func TestRefusesADaemonOfAnotherUser(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to run a process as another user")
	}
	const nobody = 65534
	bin, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// The test binary, where the other user may run it.
	shared, err := os.MkdirTemp("", "nookshared")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(shared) })
	must(t, os.Chmod(shared, 0o777))
	exe := filepath.Join(shared, "impostor")
	b, err := os.ReadFile(bin)
	must(t, err)
	must(t, os.WriteFile(exe, b, 0o755))

	startImpostor := func(sock string) *bufio.Reader {
		cmd := exec.Command(exe)
		cmd.Env = append(os.Environ(), "NOOK_TEST_IMPOSTOR="+sock)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
		out, err := cmd.StdoutPipe()
		must(t, err)
		must(t, cmd.Start())
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		r := bufio.NewReader(out)
		if line, err := r.ReadString('\n'); err != nil || line != "ready\n" {
			t.Fatalf("impostor: %q %v", line, err)
		}
		return r
	}
	received := func(r *bufio.Reader) string {
		line, _ := r.ReadString('\n')
		return strings.TrimSpace(line)
	}

	// The other user owns the socket directory (created /tmp/sandboxd-$UID
	// before us).
	theirs := filepath.Join(shared, "sandboxd-"+strconv.Itoa(os.Getuid()))
	must(t, os.Mkdir(theirs, 0o700))
	must(t, os.Chown(theirs, nobody, nobody))
	r := startImpostor(filepath.Join(theirs, "sandboxd.sock"))
	_, err = client.New(filepath.Join(theirs, "sandboxd.sock")).Version(ctx(t))
	if !errors.Is(err, errdefs.ErrUnauthorized) || !strings.Contains(err.Error(), theirs) || !strings.Contains(err.Error(), "uid 65534") {
		t.Fatalf("a directory of another user: %v", err)
	}
	if got := received(r); got != "received 0" {
		t.Fatalf("the impostor %s", got)
	}

	// Our directory and a socket file of ours, but the process behind it is
	// another user's: only the peer credentials tell.
	ours, err := os.MkdirTemp("", "nookours")
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(ours) })
	tmp := filepath.Join(theirs, "other.sock")
	r = startImpostor(tmp)
	sock := filepath.Join(ours, "sandboxd.sock")
	must(t, os.Rename(tmp, sock))
	must(t, os.Lchown(sock, os.Getuid(), os.Getgid()))
	_, err = client.New(sock).Version(ctx(t))
	if !errors.Is(err, errdefs.ErrUnauthorized) || !strings.Contains(err.Error(), sock) || !strings.Contains(err.Error(), "process serving it runs as") || !strings.Contains(err.Error(), "uid 65534") {
		t.Fatalf("a peer of another user: %v", err)
	}
	if got := received(r); got != "received 0" {
		t.Fatalf("the impostor %s", got)
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestExecRefusesArgvThatIsNotUTF8: JSON would replace the bytes with
// U+FFFD and run another command; the client refuses before sending.
func TestExecRefusesArgvThatIsNotUTF8(t *testing.T) {
	s, c := start(t)
	for _, req := range []ipc.ExecRequest{
		{Target: ipc.Target{Cwd: "/"}, Argv: []string{"rm", "file-\xff"}},
		{Target: ipc.Target{Cwd: "/"}, Argv: []string{"true"}, Env: map[string]string{"X": "\xfe"}},
	} {
		if _, err := c.Exec(ctx(t), req, client.ExecOptions{}); !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "not valid UTF-8") {
			t.Fatalf("%q: %v", req.Argv, err)
		}
	}
	if n := len(s.Sessions.Requests()); n != 0 {
		t.Fatalf("%d requests reached the daemon", n)
	}
}

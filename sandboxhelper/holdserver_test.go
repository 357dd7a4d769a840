//go:build linux

package sandboxhelper

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/sandboxhelper/hold"
)

func holdID(t *testing.T) string {
	t.Helper()
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// holdMain runs `hold args...` as the helper at state/bin would, with a
// keeper of its own that cannot start: only the server can run the
// command.
func holdMain(t *testing.T, state string, stdin string, args ...string) (int, string, string) {
	t.Helper()
	self := filepath.Join(state, "bin", "sandboxd-helper-0123456789abcdef")
	o := hold.Options{Self: filepath.Join(t.TempDir(), "no-keeper"), Server: func(ctx context.Context, id string, req hold.SpawnRequest) error {
		return askHold(ctx, self, id, req)
	}, Stream: func(ctx context.Context, id string, req hold.SpawnRequest) (io.WriteCloser, io.Reader, error) {
		return askHoldStream(ctx, self, id, req)
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var out, errb bytes.Buffer
	code := hold.MainWith(ctx, o, args, strings.NewReader(stdin), &out, &errb)
	return code, out.String(), errb.String()
}

// TestHoldStartHasTheServerKeepTheCommand: with a server serving the
// checkout, `hold start` starts no keeper: the server is the command's
// parent, and the command's output, exit code and stdin are as a
// keeper's.
func TestHoldStartHasTheServerKeepTheCommand(t *testing.T) {
	state := servedState(t)
	wd := t.TempDir()
	t.Chdir(wd)
	id := holdID(t)
	// An empty stdin in frames: the 4-byte empty frame is its end.
	code, out, errs := holdMain(t, state, "\x00\x00\x00\x00", "start", id, hold.StdinFrames, "--", "sh", "-c", `echo $PPID; pwd; echo oops >&2; exit 3`)
	if code != 3 {
		t.Fatalf("hold start exited %d, want the command's 3 (stderr %q)", code, errs)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 || lines[0] != strconv.Itoa(os.Getpid()) {
		t.Fatalf("the command's parent is %q, want the server's pid %d (output %q)", lines[0], os.Getpid(), out)
	}
	if lines[1] != wd {
		t.Fatalf("the command ran in %q, want the caller's %q", lines[1], wd)
	}
	if errs != "oops\n" {
		t.Fatalf("stderr %q, want the command's", errs)
	}
	// Stdin frames reach the command the server keeps.
	code, out, errs = holdMain(t, state, "\x00\x00\x00\x06hello\n\x00\x00\x00\x00", "start", holdID(t), hold.StdinFrames, "--", "sh", "-c", `cat; echo end`)
	if code != 0 || out != "hello\nend\n" {
		t.Fatalf("hold start of cat exited %d with %q (stderr %q), want 0 and its stdin", code, out, errs)
	}
	// The same id again runs nothing.
	if code, _, _ := holdMain(t, state, "", "start", id, "--", "sh", "-c", "echo again"); code != hold.ExitStarted {
		t.Fatalf("a second start of the id exited %d, want %d", code, hold.ExitStarted)
	}
}

// TestHoldStartNeverRunsACommandAServerSaidItKept: a process that
// impersonates the server and answers "kept" without starting anything
// leaves the start nothing to follow: it says so and runs nothing. A
// command that removed its own record looks the same from here, and it
// must not run twice.
func TestHoldStartNeverRunsACommandAServerSaidItKept(t *testing.T) {
	state := newState(t)
	dir := Dir(state)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	inst := "0123456789abcdef"
	addr, release, err := sockAddr(dir, socketName(inst))
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	ln, err := net.Listen("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			_, _ = bufio.NewReader(c).ReadString('\n')
			_ = json.NewEncoder(c).Encode(answer{Instance: inst, Held: holdKept})
			c.Close()
		}
	}()
	sum := strings.Repeat("ab", 32)
	if err := os.WriteFile(filepath.Join(dir, "server"), []byte(inst+" "+sum+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	counter := filepath.Join(t.TempDir(), "ran")
	code, _, errs := holdMain(t, state, "", "start", holdID(t), "--", "sh", "-c", "echo ran >> "+counter)
	if code != hold.ExitFailed || errs == "" {
		t.Fatalf("hold start after a false \"kept\" exited %d (stderr %q), want %d and why", code, errs, hold.ExitFailed)
	}
	if _, err := os.Stat(counter); !os.IsNotExist(err) {
		t.Fatalf("the command ran after a false \"kept\" (%v)", err)
	}
}

// TestServerDoesNotIdleAwayWhileItKeepsACommand: a server that keeps a
// held command does not exit for being asked nothing (which would take
// the command's output and status with it); it does once the command
// ended and its idle time passed.
func TestServerDoesNotIdleAwayWhileItKeepsACommand(t *testing.T) {
	state := newState(t)
	idle := 200 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := serveAt(t, ctx, state, idle)
	if _, err := Ping(context.Background(), state, 10*time.Second); err != nil {
		t.Fatalf("ping found no server: %v", err)
	}
	id := holdID(t)
	if code, _, errs := holdMain(t, state, "", "launch", id, "--", "sh", "-c", "sleep 1.5; echo kept"); code != 0 {
		t.Fatalf("hold launch exited %d: %s", code, errs)
	}
	select {
	case err := <-done:
		t.Fatalf("the server exited while it kept a command (%v)", err)
	case <-time.After(1200 * time.Millisecond):
	}
	code, out, errs := holdMain(t, state, "", "attach", id, "0", "0")
	if code != 0 || out != "kept\n" {
		t.Fatalf("attach after the idle time exited %d with %q (stderr %q), want the command's output", code, out, errs)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the server did not exit once its command ended and it was idle")
	}
}

// gatedWriter blocks every write until open is closed, as a start whose
// channel stopped taking its output.
type gatedWriter struct {
	open chan struct{}
	buf  bytes.Buffer
}

func (g *gatedWriter) Write(p []byte) (int, error) {
	<-g.open
	return g.buf.Write(p)
}

// TestStreamedStartThatFallsBehindGetsTheRestFromTheFiles: a start that
// takes none of the command's output (its channel stalled) neither stops
// the command nor makes the server keep its output in memory: the server
// stops sending past its bound and the command ends meanwhile; once the
// start takes output again, it gets the rest from the files, from the
// bytes it had, every byte exactly once, and the command's exit code.
func TestStreamedStartThatFallsBehindGetsTheRestFromTheFiles(t *testing.T) {
	state := servedState(t)
	t.Chdir(t.TempDir())
	self := filepath.Join(state, "bin", "sandboxd-helper-0123456789abcdef")
	streamed := false
	o := hold.Options{Self: filepath.Join(t.TempDir(), "no-keeper"), Stream: func(ctx context.Context, id string, req hold.SpawnRequest) (io.WriteCloser, io.Reader, error) {
		c, rd, err := askHoldStream(ctx, self, id, req)
		streamed = err == nil
		return c, rd, err
	}}
	id := holdID(t)
	// 4 MiB of numbered lines, past the server's bound of what it queues.
	const lines = 500000
	out := &gatedWriter{open: make(chan struct{})}
	codec := make(chan int, 1)
	go func() {
		code := hold.MainWith(context.Background(), o, []string{"start", id, hold.StdinFrames, "--", "sh", "-c", "seq 1 " + strconv.Itoa(lines) + "; exit 4"}, strings.NewReader("\x00\x00\x00\x00"), out, io.Discard)
		codec <- code
	}()
	root, err := hold.DefaultRoot()
	if err != nil {
		t.Fatal(err)
	}
	h := &hold.Holder{Root: root}
	deadline := time.Now().Add(20 * time.Second)
	for {
		s, _ := h.State(id)
		if s.Ended {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the command did not end while its start took no output (state %+v)", s)
		}
		time.Sleep(20 * time.Millisecond)
	}
	close(out.open)
	select {
	case code := <-codec:
		if code != 4 {
			t.Fatalf("hold start exited %d, want the command's 4", code)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("hold start did not end once its output was taken again")
	}
	if !streamed {
		t.Fatal("the start was not streamed")
	}
	var want bytes.Buffer
	for i := 1; i <= lines; i++ {
		want.WriteString(strconv.Itoa(i))
		want.WriteByte('\n')
	}
	if got := out.buf.Bytes(); !bytes.Equal(got, want.Bytes()) {
		t.Fatalf("the output is %d bytes, not the command's %d, or differs", len(got), want.Len())
	}
}

// notifyWriter keeps what is written and says when it first holds want.
type notifyWriter struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	want string
	seen chan struct{}
}

func (n *notifyWriter) Write(p []byte) (int, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.buf.Write(p)
	if n.seen != nil && strings.Contains(n.buf.String(), n.want) {
		close(n.seen)
		n.seen = nil
	}
	return len(p), nil
}

// blockedStdin is 1 MiB of framed stdin, then nothing, never ending.
type blockedStdin struct{ left int }

func (b *blockedStdin) Read(p []byte) (int, error) {
	if b.left <= 0 {
		select {}
	}
	const chunk = 16 << 10
	if len(p) < 4+chunk {
		return 0, io.ErrShortBuffer
	}
	binary.BigEndian.PutUint32(p, chunk)
	clear(p[4 : 4+chunk])
	b.left -= chunk
	return 4 + chunk, nil
}

// TestStreamedStartRelaysSignalsToTheCommand: a signal the start gets
// (the client's, through the channel) reaches the command the server
// keeps, even behind stdin the command does not read.
func TestStreamedStartRelaysSignalsToTheCommand(t *testing.T) {
	state := servedState(t)
	t.Chdir(t.TempDir())
	self := filepath.Join(state, "bin", "sandboxd-helper-0123456789abcdef")
	o := hold.Options{Self: filepath.Join(t.TempDir(), "no-keeper"), Stream: func(ctx context.Context, id string, req hold.SpawnRequest) (io.WriteCloser, io.Reader, error) {
		return askHoldStream(ctx, self, id, req)
	}}
	id := holdID(t)
	root, err := hold.DefaultRoot()
	if err != nil {
		t.Fatal(err)
	}
	// The command loops until signaled: it is stopped whatever happens.
	t.Cleanup(func() { _ = (&hold.Holder{Root: root}).Signal(id, syscall.SIGKILL) })
	seen := make(chan struct{})
	out := &notifyWriter{want: "ready", seen: seen}
	codec := make(chan int, 1)
	go func() {
		// No end of stdin: the command is not ended by its input.
		codec <- hold.MainWith(context.Background(), o, []string{"start", id, hold.StdinFrames, "--", "sh", "-c", `trap 'echo got; exit 9' USR1; echo ready; while :; do sleep 0.05; done`}, &blockedStdin{left: 1 << 20}, out, io.Discard)
	}()
	select {
	case <-seen:
	case <-time.After(10 * time.Second):
		t.Fatal("the command did not start")
	}
	// The start relays the signals its process gets; it listens once
	// the command's output reaches it. By now the stdin fills the pipe
	// and the socket.
	time.Sleep(200 * time.Millisecond)
	if err := syscall.Kill(os.Getpid(), syscall.SIGUSR1); err != nil {
		t.Fatal(err)
	}
	select {
	case code := <-codec:
		out.mu.Lock()
		defer out.mu.Unlock()
		if code != 9 || !strings.Contains(out.buf.String(), "got") {
			t.Fatalf("hold start exited %d with %q, want the trap's 9 and its line", code, out.buf.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the signal did not reach the command")
	}
}

// TestHoldStartFallsBackToAServerThatDoesNotStream: a server of an
// older helper answers a streamed start with an error (it does not know
// the question); the start asks it the plain way and the command runs
// once, kept by that server, with its output and exit code.
func TestHoldStartFallsBackToAServerThatDoesNotStream(t *testing.T) {
	state := servedState(t)
	t.Chdir(t.TempDir())
	self := filepath.Join(state, "bin", "sandboxd-helper-0123456789abcdef")
	asked := 0
	o := hold.Options{Self: filepath.Join(t.TempDir(), "no-keeper"),
		Stream: func(ctx context.Context, id string, req hold.SpawnRequest) (io.WriteCloser, io.Reader, error) {
			// What askHoldStream makes of an older server's answer.
			return nil, nil, fmt.Errorf("%w: unknown question", hold.ErrRefused)
		},
		Server: func(ctx context.Context, id string, req hold.SpawnRequest) error {
			asked++
			return askHold(ctx, self, id, req)
		}}
	counter := filepath.Join(t.TempDir(), "ran")
	var out, errb bytes.Buffer
	code := hold.MainWith(context.Background(), o, []string{"start", holdID(t), hold.StdinFrames, "--", "sh", "-c", "echo ran >> " + counter + "; echo $PPID; exit 6"}, strings.NewReader("\x00\x00\x00\x00"), &out, &errb)
	if code != 6 || asked != 1 {
		t.Fatalf("hold start exited %d (stderr %q) after %d plain questions, want the command's 6 after one", code, errb.String(), asked)
	}
	if strings.TrimSpace(out.String()) != strconv.Itoa(os.Getpid()) {
		t.Fatalf("the command's parent is %q, want the server's pid %d", out.String(), os.Getpid())
	}
	if b, _ := os.ReadFile(counter); string(b) != "ran\n" {
		t.Fatalf("the command ran %d times", strings.Count(string(b), "ran"))
	}
}

// TestServerSweepsExecsThatEndedADayAgo: a starting server removes the
// holder's files of execs that ended more than a day ago and that no
// daemon named to forget; a recent one stays.
func TestServerSweepsExecsThatEndedADayAgo(t *testing.T) {
	state := newState(t)
	root, err := hold.DefaultRoot()
	if err != nil {
		t.Fatal(err)
	}
	old, recent := holdID(t), holdID(t)
	for _, id := range []string{old, recent} {
		if err := os.MkdirAll(filepath.Join(root, id), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, id, "status"), []byte(`{"exit_code":0}`), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	long := time.Now().Add(-25 * time.Hour)
	if err := os.Chtimes(filepath.Join(root, old, "status"), long, long); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := serveAt(t, ctx, state, time.Hour)
	defer func() { cancel(); <-done }()
	if _, err := Ping(context.Background(), state, 10*time.Second); err != nil {
		t.Fatalf("ping found no server: %v", err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(filepath.Join(root, old)); errors.Is(err, os.ErrNotExist) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the exec that ended 25 hours ago is still kept after the server started")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, err := os.Stat(filepath.Join(root, recent)); err != nil {
		t.Errorf("the exec that just ended was swept: %v", err)
	}
}

// TestHoldStartNeverRunsTwiceACommandThatRemovesItsRecord: a command
// that removes the holder's record of itself while its start still
// looks for it (here the start waits until it is gone) is not started
// again, streamed or not: the streamed start follows it on its stream,
// the plain one says it may or may not have run.
func TestHoldStartNeverRunsTwiceACommandThatRemovesItsRecord(t *testing.T) {
	for _, streamed := range []bool{true, false} {
		t.Run(fmt.Sprintf("streamed=%v", streamed), func(t *testing.T) {
			state := servedState(t)
			root := os.Getenv(hold.RootEnv)
			id := holdID(t)
			gone := func() {
				deadline := time.Now().Add(10 * time.Second)
				for _, err := os.Stat(filepath.Join(root, id)); err == nil && time.Now().Before(deadline); _, err = os.Stat(filepath.Join(root, id)) {
					time.Sleep(10 * time.Millisecond)
				}
			}
			self := filepath.Join(state, "bin", "sandboxd-helper-0123456789abcdef")
			o := hold.Options{Self: filepath.Join(t.TempDir(), "no-keeper"), Server: func(ctx context.Context, id string, req hold.SpawnRequest) error {
				err := askHold(ctx, self, id, req)
				gone()
				return err
			}}
			if streamed {
				o.Stream = func(ctx context.Context, id string, req hold.SpawnRequest) (io.WriteCloser, io.Reader, error) {
					c, rd, err := askHoldStream(ctx, self, id, req)
					gone()
					return c, rd, err
				}
			}
			counter := filepath.Join(t.TempDir(), "ran")
			// The keeper may still be writing its first files into the
			// record: the removal is retried until it holds.
			script := fmt.Sprintf(`echo ran >> %s; d="%s/%s"; until rm -rf "$d" 2>/dev/null && [ ! -e "$d" ]; do sleep 0.01; done; echo removed; exit 4`, counter, root, id)
			var out, errb bytes.Buffer
			code := hold.MainWith(context.Background(), o, []string{"start", id, hold.StdinFrames, "--", "sh", "-c", script}, strings.NewReader("\x00\x00\x00\x00"), &out, &errb)
			b, _ := os.ReadFile(counter)
			if n := strings.Count(string(b), "ran"); n != 1 {
				t.Fatalf("the command ran %d times (exit %d, stdout %q, stderr %q), want once", n, code, out.String(), errb.String())
			}
			switch {
			case streamed && (code != 4 || out.String() != "removed\n"):
				t.Fatalf("the streamed start: exit %d, stdout %q, stderr %q; want the command's 4 and its line", code, out.String(), errb.String())
			case !streamed && (code != hold.ExitFailed || !strings.Contains(errb.String(), "may or may not have run")):
				t.Fatalf("the plain start: exit %d, stderr %q; want %d saying it may or may not have run", code, errb.String(), hold.ExitFailed)
			}
		})
	}
}

// servedState is a new state directory that a server serves until the
// test ends.
func servedState(t *testing.T) string {
	t.Helper()
	state := newState(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := serveAt(t, ctx, state, time.Hour)
	t.Cleanup(func() { cancel(); <-done })
	if _, err := Ping(context.Background(), state, 10*time.Second); err != nil {
		t.Fatalf("ping found no server: %v", err)
	}
	return state
}

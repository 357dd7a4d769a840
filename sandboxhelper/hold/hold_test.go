package hold

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// keeperEnv makes the test binary the keeper (the helper's `hold keep`).
const keeperEnv = "HOLD_TEST_KEEPER"

func TestMain(m *testing.M) {
	if root := os.Getenv(keeperEnv); root != "" {
		h := &Holder{Root: root, Cap: 1 << 10}
		if err := h.Keep(os.Args[len(os.Args)-1]); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func newHolder(t *testing.T) *Holder {
	t.Helper()
	root := t.TempDir()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(keeperEnv, root)
	return &Holder{Root: root, Keeper: []string{self}, Cap: 1 << 10}
}

func newID(t *testing.T) string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// waitFor polls cond for up to 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestCommandOutlivesItsAttachAndRunsOnce: an attach that ends (its
// channel was lost) leaves the command running; a new attach from the
// offsets received gets the rest and the command's own exit code; a
// second start of the same id runs nothing.
func TestCommandOutlivesItsAttachAndRunsOnce(t *testing.T) {
	h := newHolder(t)
	id := newID(t)
	counter := filepath.Join(t.TempDir(), "ran")
	script := "echo ran >> " + counter + "; echo one; echo warn >&2; sleep 0.5; echo two; exit 3"
	if err := h.Start(id, []string{"sh", "-c", script}); err != nil {
		t.Fatal(err)
	}
	// The first attach is cut off once "one" arrived, as a lost channel.
	var out1, err1 bytes.Buffer
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := h.Attach(ctx, id, 0, 0, &out1, &err1)
		done <- err
	}()
	waitFor(t, "the first line", func() bool {
		s, _ := h.State(id)
		return s.OutLen >= int64(len("one\n"))
	})
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("a cut attach: %v", err)
	}
	if err := h.Start(id, []string{"sh", "-c", script}); !errors.Is(err, ErrStarted) {
		t.Fatalf("a second start of the same id: %v, want ErrStarted", err)
	}
	var out2, err2 bytes.Buffer
	code, err := h.Attach(context.Background(), id, int64(out1.Len()), int64(err1.Len()), &out2, &err2)
	if err != nil || code != 3 {
		t.Fatalf("reattach: exit %d, %v", code, err)
	}
	if got := out1.String() + out2.String(); got != "one\ntwo\n" {
		t.Errorf("stdout across the reattach: %q", got)
	}
	if got := err1.String() + err2.String(); got != "warn\n" {
		t.Errorf("stderr across the reattach: %q", got)
	}
	if b, _ := os.ReadFile(counter); string(b) != "ran\n" {
		t.Errorf("the command ran %d times", strings.Count(string(b), "ran"))
	}
	s, err := h.State(id)
	if err != nil || !s.Started || !s.Ended || s.ExitCode == nil || *s.ExitCode != 3 {
		t.Errorf("state %+v, %v", s, err)
	}
}

// TestStateSignalAndBounds: an unknown id is not started; a signal ends
// the command with 128+n; output past the cap is counted as truncated; an
// id the daemon did not make is refused; an offset past the output is an
// error, not a rewind.
func TestStateSignalAndBounds(t *testing.T) {
	h := newHolder(t)
	if s, err := h.State(newID(t)); err != nil || s.Started {
		t.Fatalf("unknown id: %+v, %v", s, err)
	}
	if err := h.Start("../../etc", []string{"true"}); err == nil {
		t.Fatal("an id that names a path was accepted")
	}
	id := newID(t)
	if err := h.Start(id, []string{"sh", "-c", "head -c 5000 /dev/zero; sleep 30"}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the command to start", func() bool { s, _ := h.State(id); return s.PID > 0 && s.OutLen > 0 })
	if err := h.Signal(id, syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	code, err := h.Attach(ctx, id, 0, 0, &out, &bytes.Buffer{})
	if err != nil || code != 128+int(syscall.SIGTERM) {
		t.Fatalf("after TERM: exit %d, %v", code, err)
	}
	s, _ := h.State(id)
	if s.Signal != "TERM" || !s.Truncated || out.Len() != 1<<10 {
		t.Errorf("state %+v, %d bytes kept; want TERM, truncated, 1024 bytes", s, out.Len())
	}
	if _, err := h.Attach(ctx, id, int64(out.Len())+1, 0, &out, &bytes.Buffer{}); err == nil {
		t.Error("an offset past the output was accepted")
	}
}

// TestStdinReachesTheCommandAcrossFeeds: what one attach feeds and then
// what a later one feeds reach the command in order, and the end of the
// last one's input ends the command's stdin.
func TestStdinReachesTheCommandAcrossFeeds(t *testing.T) {
	h := newHolder(t)
	id := newID(t)
	if err := h.Start(id, []string{"sh", "-c", "read a; echo got $a; cat; echo end"}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	fed := make(chan error, 1)
	go func() { fed <- h.Feed(ctx, id, pr) }()
	if _, err := pw.Write([]byte("one\n")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the first line to be read", func() bool { s, _ := h.State(id); return s.OutLen >= int64(len("got one\n")) })
	cancel() // this attach's channel is gone
	pw.Close()
	<-fed
	if err := h.Feed(context.Background(), id, strings.NewReader("two\nthree\n")); err != nil {
		t.Fatal(err)
	}
	if err := h.EOF(id); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	actx, acancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer acancel()
	code, err := h.Attach(actx, id, 0, 0, &out, &bytes.Buffer{})
	if err != nil || code != 0 {
		t.Fatalf("exit %d, %v", code, err)
	}
	if out.String() != "got one\ntwo\nthree\nend\n" {
		t.Errorf("output %q", out.String())
	}
}

// TestAttachWakesWhenTheKeeperEndsAndTheCommandGetsNoLock: an attach
// waiting on the keeper's run lock returns as the command ends, and the
// command (which may leave processes behind) does not hold that lock.
func TestAttachWakesWhenTheKeeperEndsAndTheCommandGetsNoLock(t *testing.T) {
	h := newHolder(t)
	id := newID(t)
	if err := h.Start(id, []string{"sh", "-c", "if [ -e /proc/$$/fd/3 ]; then echo leaked; fi; sleep 0.2"}); err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	code, err := h.Attach(context.Background(), id, 0, 0, &out, &errb)
	if err != nil || code != 0 {
		t.Fatalf("attach: %d, %v (%s)", code, err, errb.String())
	}
	if strings.Contains(out.String(), "leaked") {
		t.Errorf("the command inherited the keeper's run lock")
	}
	dir, _ := h.dir(id)
	run, err := openRunLock(dir)
	if err != nil {
		t.Fatalf("no run lock: %v", err)
	}
	defer run.Close()
	// The keeper exits just after the status is written.
	waitFor(t, "the keeper to free the run lock", func() bool {
		return syscall.Flock(int(run.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil
	})
}

func frames(parts ...string) []byte {
	var b []byte
	for _, p := range parts {
		b = binary.BigEndian.AppendUint32(b, uint32(len(p)))
		b = append(b, p...)
	}
	return b
}

// TestFramedStdinEndsOnlyWithTheEndFrame: framed input cut short (its
// channel lost) leaves the command's stdin open for the next attach; the
// empty frame ends it, with no `hold eof` of its own.
func TestFramedStdinEndsOnlyWithTheEndFrame(t *testing.T) {
	h := newHolder(t)
	id := newID(t)
	if err := h.Start(id, []string{"sh", "-c", "cat; echo end"}); err != nil {
		t.Fatal(err)
	}
	// The channel is lost between frames, then within a header.
	if err := h.FeedFrames(context.Background(), id, bytes.NewReader(frames("one\n"))); err != nil {
		t.Fatal(err)
	}
	_ = h.FeedFrames(context.Background(), id, bytes.NewReader([]byte{0, 0}))
	waitFor(t, "the first line", func() bool { s, _ := h.State(id); return s.OutLen >= 4 })
	time.Sleep(300 * time.Millisecond)
	if s, _ := h.State(id); s.Ended {
		t.Fatal("the command's stdin ended with input cut short")
	}
	if err := h.FeedFrames(context.Background(), id, bytes.NewReader(frames("two\n", ""))); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	actx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	code, err := h.Attach(actx, id, 0, 0, &out, &bytes.Buffer{})
	if err != nil || code != 0 || out.String() != "one\ntwo\nend\n" {
		t.Fatalf("exit %d, %v, output %q", code, err, out.String())
	}
}

// TestAttachEndsWhenTheKeeperDiesWithoutAStatus: a keeper that ends
// without writing the status (killed, or the server that kept the
// command stopped) ends the attach with ErrKeeperGone at once, rather
// than leaving it waiting for a status that never comes.
func TestAttachEndsWhenTheKeeperDiesWithoutAStatus(t *testing.T) {
	h := newHolder(t)
	truePath, err := exec.LookPath("true")
	if err != nil {
		t.Skip("no true on PATH")
	}
	h.Keeper = []string{truePath}
	id := newID(t)
	if err := h.Start(id, []string{"sleep", "30"}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	_, err = h.Attach(ctx, id, 0, 0, io.Discard, io.Discard)
	if !errors.Is(err, ErrKeeperGone) {
		t.Fatalf("attach to an exec whose keeper died: %v after %v, want ErrKeeperGone", err, time.Since(start))
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("attach took %v to see the keeper gone", d)
	}
}

// TestConcurrentStartsOfOneIDRunItOnce: starts of one id racing each
// other (a retried start whose answer was lost) run the command once,
// whether the exec's directory is prepared and renamed into place or,
// where a rename cannot refuse to replace, made in place; the others get
// ErrStarted, an attach gets the command's end, and no prepared
// directory is left behind.
func TestConcurrentStartsOfOneIDRunItOnce(t *testing.T) {
	for _, inPlace := range []bool{false, true} {
		t.Run(fmt.Sprintf("inPlace=%v", inPlace), func(t *testing.T) {
			if inPlace {
				renameDir = func(string, string) error { return errNoReplaceUnsupported }
				defer func() { renameDir = renameNoReplace }()
			}
			h := newHolder(t)
			id := newID(t)
			counter := filepath.Join(t.TempDir(), "ran")
			argv := []string{"sh", "-c", "echo ran >> " + counter + "; sleep 0.2; exit 5"}
			const n = 8
			errs := make(chan error, n)
			for i := 0; i < n; i++ {
				go func() {
					_, err := h.Spawn(id, argv, os.Environ(), t.TempDir())
					errs <- err
				}()
			}
			started := 0
			for i := 0; i < n; i++ {
				switch err := <-errs; {
				case err == nil:
					started++
				case !errors.Is(err, ErrStarted):
					t.Fatalf("a start: %v", err)
				}
			}
			if started != 1 {
				t.Fatalf("%d starts ran the command, want 1", started)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			code, err := h.Attach(ctx, id, 0, 0, io.Discard, io.Discard)
			if err != nil || code != 5 {
				t.Fatalf("attach: exit %d, %v; want 5", code, err)
			}
			if b, _ := os.ReadFile(counter); string(b) != "ran\n" {
				t.Errorf("the command ran %d times", strings.Count(string(b), "ran"))
			}
			names, _ := os.ReadDir(h.Root)
			if len(names) != 1 || names[0].Name() != id {
				var got []string
				for _, e := range names {
					got = append(got, e.Name())
				}
				t.Errorf("the holder's directory holds %v, want only the exec's", got)
			}
		})
	}
}

// TestAttachWaitsForTheRunFileOfADirectoryMadeInPlace: where the exec's
// directory is made in place, an attach that comes between the
// directory and its run lock (the keeper places it just after) waits on
// that lock instead of taking the unlocked directory for a keeper gone.
func TestAttachWaitsForTheRunFileOfADirectoryMadeInPlace(t *testing.T) {
	h := newHolder(t)
	id := newID(t)
	dir, err := h.dir(id)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		code, err := h.Attach(ctx, id, 0, 0, io.Discard, io.Discard)
		if err == nil && code != 6 {
			err = fmt.Errorf("exit %d, want 6", code)
		}
		got <- err
	}()
	time.Sleep(50 * time.Millisecond)
	run, err := lockRun(dir)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	if err := writeJSON(filepath.Join(dir, statusFile), status{ExitCode: 6}); err != nil {
		t.Fatal(err)
	}
	run.Close()
	if err := <-got; err != nil {
		t.Fatalf("attach: %v", err)
	}
}

// TestSignalDuringTheStartWaitsForThePid: the command's directory comes
// before its pid (written beside the command, after its output may have
// reached the caller); a signal sent in between reaches the command once
// the pid is there, instead of being lost.
func TestSignalDuringTheStartWaitsForThePid(t *testing.T) {
	h := newHolder(t)
	id := newID(t)
	dir, run, err := h.create(id, []string{"sleep", "30"}, false)
	if err != nil {
		t.Fatal(err)
	}
	defer run.Close()
	cmd := exec.Command("sleep", "30")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	sent := make(chan error, 1)
	go func() { sent <- h.Signal(id, syscall.SIGTERM) }()
	time.Sleep(100 * time.Millisecond)
	if err := writeJSON(filepath.Join(dir, stateFile), procState{PID: cmd.Process.Pid, Argv: []string{"sleep", "30"}}); err != nil {
		t.Fatal(err)
	}
	if err := <-sent; err != nil {
		t.Fatalf("a signal during the start: %v", err)
	}
	ended := make(chan error, 1)
	go func() { ended <- cmd.Wait() }()
	select {
	case err := <-ended:
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || ws.Signal() != syscall.SIGTERM {
			t.Fatalf("the command ended with %v, want TERM", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the command did not get the signal sent while its start was under way")
	}
}

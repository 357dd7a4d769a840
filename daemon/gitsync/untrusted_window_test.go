//go:build linux

package gitsync

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// The window before the exchange helper's prctl(PR_SET_DUMPABLE, 0): the
// exec's shell, which becomes the helper, and the helper until the prctl
// are dumpable, so another process of the sandbox's user can open
// /proc/<pid>/fd/1 (the channel) then, and keep it.

// windowRunner runs commands on Runner; in the exchange's command, the
// shell that becomes the helper first writes its pid to dir/pid and waits
// (at most 10 s) for dir/go: the window, held open while the test's
// process of the same user opens the channel.
type windowRunner struct {
	Runner
	dir string
}

func (w windowRunner) Run(ctx context.Context, command string, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	if strings.Contains(command, " exchange ") {
		command = fmt.Sprintf("echo $$ >%[1]s/pid\ni=0; while [ ! -f %[1]s/go ] && [ $i -lt 1000 ]; do sleep 0.01; i=$((i+1)); done\n", shellWord(w.dir)) + command
	}
	return w.Runner.Run(ctx, command, stdin, stdout, stderr)
}

// openChannel waits (at most 10 s) for the exchange's shell to write its
// pid under dir and opens its stdout through /proc, as a background
// process of the user that polls /proc can.
func openChannel(t *testing.T, dir string) *os.File {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, err := os.ReadFile(filepath.Join(dir, "pid"))
		if pid, perr := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && perr == nil && pid > 0 {
			f, err := os.OpenFile(fmt.Sprintf("/proc/%d/fd/1", pid), os.O_WRONLY, 0)
			if err != nil {
				t.Errorf("open the channel of the exchange's shell (pid %d) in the window: %v", pid, err)
				return nil
			}
			return f
		}
		if time.Now().After(deadline) {
			t.Errorf("waited 10 s for the exchange's shell to write %s/pid", dir)
			return nil
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitFile waits (at most 10 s) for path to exist.
func waitFile(t *testing.T, path string) bool {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if _, err := os.Stat(path); err == nil {
			return true
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Errorf("waited 10 s for %s", path)
	return false
}

// windowExchange runs command as an exchange on f through the window,
// with attack run (in a goroutine, as another process of the user) once
// the window is open; a decline sends the command to the separate steps,
// as the session does. It returns the command's stdout and the outcome.
func windowExchange(t *testing.T, f *fixture, command string, attack func(dir string, channel *os.File)) (string, Fused, error) {
	t.Helper()
	ctx := context.Background()
	dir := t.TempDir()
	p, err := f.s.Prepare(ctx, f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	p.Sandbox = "fixture"
	x, ok, err := f.s.Fuse(ctx, f.r, p, command)
	if err != nil || !ok {
		t.Fatalf("fuse: %v %v", ok, err)
	}
	attacked := make(chan struct{})
	go func() {
		defer close(attacked)
		ch := openChannel(t, dir)
		if ch == nil {
			return
		}
		defer ch.Close()
		attack(dir, ch)
	}()
	var stdout bytes.Buffer
	runErr := x.Run(ctx, windowRunner{Runner: f.r, dir: dir}, ExchangeIO{Stdout: &stdout, Stderr: io.Discard})
	<-attacked
	fr, err := x.Finish(ctx, f.r)
	if err == nil {
		err = runErr
	}
	if err == nil && fr.Split {
		out, sfr, serr := f.split(command)
		return stdout.String() + out, sfr, serr
	}
	return stdout.String(), fr, err
}

// A process of the user that opens the channel in the window and writes a
// hello and a decline before the helper answers does not make the daemon
// take the separate steps: its frames carry no tag, the exchange ends as
// a broken protocol, and the command runs at most once (the helper's).
func TestForgedDeclineInTheWindowBeforeThePrctlIsNotTaken(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "runs\n"})
	forged := bytes.Join([][]byte{
		frame(helperproto.FrameHelloAnswer, helperproto.HelloAnswer{Version: helperproto.Version}),
		frame(helperproto.FrameDeclined, helperproto.Declined{Reason: "run me again"}),
		frame(helperproto.FrameEnd, nil),
	}, nil)
	out, fr, err := windowExchange(t, f, "echo ran >>runs; echo done", func(dir string, ch *os.File) {
		if _, err := ch.Write(forged); err != nil {
			t.Errorf("write into the channel: %v", err)
		}
		writeFile(t, filepath.Join(dir, "go"), "")
	})
	t.Logf("%q %+v %v", out, fr, err)
	if n := runs(t, f); n > 1 {
		t.Fatalf("the command ran %d times: the forged decline was taken", n)
	}
	if fr.Split || !errors.Is(err, ErrForgedReport) {
		t.Fatalf("the forged frames were not refused: %+v %v", fr, err)
	}
}

// A process of the user that opened the channel in the window keeps it
// after the prctl; output it writes there once the command runs is not
// the command's: the caller never sees it, and the exec ends as a broken
// protocol without running the command again.
func TestChannelOpenedBeforeThePrctlCannotForgeOutput(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "runs\nrunning\nforged\n"})
	forged := dataFrame(helperproto.FrameStdout, 0, "forged\n")
	command := "echo ran >>runs; : >running; i=0; while [ ! -f forged ] && [ $i -lt 1000 ]; do sleep 0.01; i=$((i+1)); done; echo real"
	out, fr, err := windowExchange(t, f, command, func(dir string, ch *os.File) {
		writeFile(t, filepath.Join(dir, "go"), "")
		// The helper is past its prctl once the command runs.
		if !waitFile(t, filepath.Join(f.sandbox, "running")) {
			return
		}
		if _, err := ch.Write(forged); err != nil {
			t.Errorf("write into the channel after the prctl: %v", err)
		}
		writeFile(t, filepath.Join(f.sandbox, "forged"), "")
	})
	t.Logf("%q %+v %v", out, fr, err)
	if strings.Contains(out, "forged") {
		t.Fatalf("the caller got the forged output: %q", out)
	}
	if !errors.Is(err, ErrForgedReport) {
		t.Fatalf("the forged frame was not refused: %+v %v", fr, err)
	}
	if n := runs(t, f); n != 1 {
		t.Fatalf("the command ran %d times, want once", n)
	}
}

// A helper's whole answer taken out of the channel on the way (a process
// of the user that opened the pipe in the window can read it before the
// agent does; here the runner drops it) leaves the daemon without a word
// from a helper that exited 0: the exec says the command may have
// completed and does not send it to the separate steps.
func TestAnswerTakenOutOfTheChannelDoesNotRunTheCommandAgain(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "runs\n"})
	ctx := context.Background()
	p, err := f.s.Prepare(ctx, f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	p.Sandbox = "fixture"
	command := "echo ran >>runs"
	x, ok, err := f.s.Fuse(ctx, f.r, p, command)
	if err != nil || !ok {
		t.Fatalf("fuse: %v %v", ok, err)
	}
	taken := &frameFilter{Runner: f.r, drop: func(byte) bool { return true }}
	runErr := x.Run(ctx, taken, ExchangeIO{Stdout: io.Discard, Stderr: io.Discard})
	fr, err := x.Finish(ctx, f.r)
	if err == nil {
		err = runErr
	}
	if err == nil && fr.Split {
		// The session's way after a split.
		_, fr, err = f.split(command)
	}
	t.Logf("%+v %v", fr, err)
	if n := runs(t, f); n != 1 {
		t.Fatalf("the command ran %d times, want once", n)
	}
	if !errors.Is(err, ErrForgedReport) || !strings.Contains(err.Error(), "may or may not have completed") {
		t.Fatalf("the exec did not say the command may have completed: %+v %v", fr, err)
	}
}

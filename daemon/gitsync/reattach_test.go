//go:build linux

package gitsync

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// cutAfter is a writer that cuts the exchange (cancels its run, as a lost
// connection ends it) once it received want.
type cutAfter struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	want string
	cut  func()
}

func (c *cutAfter) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.buf.Write(p)
	if strings.Contains(c.buf.String(), c.want) {
		c.cut()
	}
	return len(p), nil
}

// heldExchange starts a synced exec of a command that prints "one", waits
// for the file go (outside the checkout), prints "two", writes made.txt
// and exits 7, and cuts its exchange after "one": the command goes on
// under the holder. It returns the exchange and the file that lets the
// command go on (created at the test's end at the latest).
func heldExchange(t *testing.T, f *fixture) (*Exchange, string) {
	t.Helper()
	ctx := context.Background()
	if _, fr, err := f.fused("true"); err != nil || !fr.Ran {
		t.Fatalf("first exec: %+v %v", fr, err)
	}
	release := filepath.Join(t.TempDir(), "go")
	t.Cleanup(func() { _ = os.WriteFile(release, nil, 0o600) })
	p, err := f.s.Prepare(ctx, f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	p.Sandbox = "fixture"
	// The loop also ends with the release file's directory, which the
	// test's end removes right after it wrote the file: a command still
	// polling then would run on after the test.
	command := "echo ran >>runs; echo one; while [ ! -e " + release + " ] && [ -d " + filepath.Dir(release) + " ]; do sleep 0.05; done; echo two; echo made >made.txt; exit 7"
	x, ok, err := f.s.Fuse(ctx, f.r, p, command)
	if err != nil || !ok {
		t.Fatalf("fuse: %v %v", ok, err)
	}
	rctx, cut := context.WithCancel(ctx)
	defer cut()
	out := &cutAfter{want: "one\n", cut: cut}
	// The test's runner reports a killed exec as its exit status, not
	// as the transport's error: what counts is the exchange's state.
	err = x.Run(rctx, f.r, ExchangeIO{Stdout: out, Stderr: io.Discard})
	if !x.Held() || x.Exited() {
		t.Fatalf("the cut exchange: %v, held %v, exited %v", err, x.Held(), x.Exited())
	}
	if got := out.buf.String(); got != "one\n" {
		t.Fatalf("output before the cut: %q", got)
	}
	return x, release
}

// A held exchange cut while its command runs is reattached on a new run:
// the rest of the output from the bytes received (nothing twice), the
// command's own status, and the pull of what it wrote after the cut, as
// after an unbroken exchange; the command ran once.
func TestHeldExchangeIsReattachedFromTheBytesReceived(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "runs\n"})
	x, release := heldExchange(t, f)
	ctx := context.Background()
	time.Sleep(200 * time.Millisecond)
	if err := os.WriteFile(release, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := x.Reattach(ctx, f.r, ExchangeIO{Stdout: &out, Stderr: io.Discard}); err != nil {
		t.Fatalf("reattach: %v", err)
	}
	fr, err := x.Finish(ctx, f.r)
	if err != nil || !fr.Ran || fr.ExitCode != 7 {
		t.Fatalf("finish: %+v %v", fr, err)
	}
	if got := out.String(); got != "two\n" {
		t.Fatalf("output after the reattach: %q, want the rest only", got)
	}
	if n := runs(t, f); n != 1 {
		t.Fatalf("the command ran %d times", n)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "made.txt"))); got != "made\n" {
		t.Fatalf("made.txt on the laptop: %q", got)
	}
}

// A reattach names only the daemon's id: a helper asked for an id its
// holder never started declines, and nothing starts under it.
func TestReattachToAnUnknownIDStartsNothing(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "runs\n"})
	x, _ := heldExchange(t, f)
	x.hold = holdID()
	err := x.Reattach(context.Background(), f.r, ExchangeIO{Stdout: io.Discard, Stderr: io.Discard})
	if !errors.Is(err, ErrReattach) {
		t.Fatalf("reattach to an unknown id: %v", err)
	}
	if fr, err := x.Finish(context.Background(), f.r); err == nil || fr.Ran {
		t.Fatalf("finish: %+v %v", fr, err)
	}
	time.Sleep(200 * time.Millisecond)
	if n := runs(t, f); n != 1 {
		t.Fatalf("the command ran %d times", n)
	}
	if _, err := os.Stat(filepath.Join(os.Getenv("SANDBOXD_HOLD_ROOT"), x.hold)); !os.IsNotExist(err) {
		t.Fatalf("the unknown id has a holder's directory: %v", err)
	}
}

// A replaced helper's answer to a reattach is held to the protocol: a
// decline, another version, output that goes back, a second start, a
// frame over the bound or an exit out of range ends the exec with an
// error; nothing is sent again and the command ran once.
func TestReplacedHelperAnswerToAReattachIsRefused(t *testing.T) {
	withHelper(t)
	hello := frame(helperproto.FrameHelloAnswer, helperproto.HelloAnswer{Version: helperproto.Version})
	cases := map[string]struct {
		frames [][]byte
		want   error
	}{
		"declined":               {[][]byte{hello, frame(helperproto.FrameDeclined, helperproto.Declined{Reason: "start it again"})}, ErrReattach},
		"another version":        {[][]byte{frame(helperproto.FrameHelloAnswer, helperproto.HelloAnswer{Version: 1})}, ErrReattach},
		"output that goes back":  {[][]byte{hello, dataFrame(helperproto.FrameStdout, 0, "one\n")}, ErrForgedReport},
		"a second start":         {[][]byte{hello, frame(helperproto.FrameStarted, helperproto.Started{})}, ErrForgedReport},
		"a frame over the bound": {[][]byte{hello, {helperproto.FrameExit, 0x7f, 0xff, 0xff, 0xff}}, ErrForgedReport},
		"exit out of range":      {[][]byte{hello, frame(helperproto.FrameExit, helperproto.Exit{Code: 300})}, ErrForgedReport},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "runs\n"})
			x, _ := heldExchange(t, f)
			bin := filepath.Join(f.sandbox, ".git", "sandboxd", "bin", f.r.helperName)
			if err := os.Remove(bin); err != nil {
				t.Fatal(err)
			}
			// The answer is tagged under the reattach's key, as the
			// helper's would be: what is refused is its content.
			answer := filepath.Join(t.TempDir(), "answer")
			writeFile(t, bin, "#!/bin/sh\n[ \"$1\" = exchange ] || exit 2\ncat "+answer+"\n")
			if err := os.Chmod(bin, 0o755); err != nil {
				t.Fatal(err)
			}
			x.opening = func(typ byte, v any) ([]byte, []byte, error) {
				b, key, err := marshalOpening(typ, v)
				writeFile(t, answer, string(taggedWith(key, c.frames)))
				return b, key, err
			}
			before := f.r.calls()
			err := x.Reattach(context.Background(), f.r, ExchangeIO{Stdout: io.Discard, Stderr: io.Discard})
			if !errors.Is(err, c.want) {
				t.Fatalf("reattach: %v, want %v", err, c.want)
			}
			if fr, err := x.Finish(context.Background(), f.r); err == nil || fr.Ran {
				t.Fatalf("finish: %+v %v", fr, err)
			}
			if n := f.r.calls() - before; n != 1 {
				t.Fatalf("%d runner calls, want the reattach alone", n)
			}
			if n := runs(t, f); n != 1 {
				t.Fatalf("the command ran %d times", n)
			}
		})
	}
}

// With durable exec off (Unheld), the helper runs the command with pipes
// of its own: output and status as before, and nothing in the holder's
// directory.
func TestUnheldExchangeRunsTheCommandWithoutTheHolder(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "runs\n"})
	if _, fr, err := f.fused("true"); err != nil || !fr.Ran {
		t.Fatalf("first exec: %+v %v", fr, err)
	}
	root := os.Getenv("SANDBOXD_HOLD_ROOT")
	before, _ := os.ReadDir(root)
	ctx := context.Background()
	p, err := f.s.Prepare(ctx, f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	x, ok, err := f.s.Fuse(ctx, f.r, p, "echo ran >>runs; echo out; echo made >made.txt; exit 3")
	if err != nil || !ok {
		t.Fatalf("fuse: %v %v", ok, err)
	}
	if err := x.Unheld(); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := x.Run(ctx, f.r, ExchangeIO{Stdout: &out, Stderr: io.Discard}); err != nil {
		t.Fatal(err)
	}
	fr, err := x.Finish(ctx, f.r)
	if err != nil || !fr.Ran || fr.ExitCode != 3 || out.String() != "out\n" || x.Held() {
		t.Fatalf("unheld exchange: %q %+v %v held %v", out.String(), fr, err, x.Held())
	}
	// The request may have the holder forget the first exec: only a new
	// id would be the unheld command's.
	after, _ := os.ReadDir(root)
	for _, e := range after {
		if !slices.ContainsFunc(before, func(b os.DirEntry) bool { return b.Name() == e.Name() }) {
			t.Fatalf("the holder kept the unheld command: %s", e.Name())
		}
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "made.txt"))); got != "made\n" {
		t.Fatalf("made.txt on the laptop: %q", got)
	}
}

// The holder keeps a held exchange's output and status only until the
// daemon saw its exit: the next exchange's request has the holder forget
// it, so the sandbox does not collect every exec's output.
func TestHolderForgetsAnExchangeTheDaemonSawEnd(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "runs\n"})
	root := os.Getenv("SANDBOXD_HOLD_ROOT")
	kept := func() []string {
		var ids []string
		entries, _ := os.ReadDir(root)
		for _, e := range entries {
			ids = append(ids, e.Name())
		}
		return ids
	}
	if _, fr, err := f.fused("echo first"); err != nil || !fr.Ran {
		t.Fatalf("first exec: %+v %v", fr, err)
	}
	first := kept()
	if len(first) != 1 {
		t.Fatalf("the holder keeps %v after the first exec, want its one exec", first)
	}
	if _, fr, err := f.fused("echo second"); err != nil || !fr.Ran {
		t.Fatalf("second exec: %+v %v", fr, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for slices.Contains(kept(), first[0]) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if now := kept(); slices.Contains(now, first[0]) || len(now) != 1 {
		t.Fatalf("the holder keeps %v after the second exec, want the second's alone (not %s)", now, first[0])
	}
}

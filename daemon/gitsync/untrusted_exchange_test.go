//go:build linux

package gitsync

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// The attacks of a hostile command on the exchange with the helper: it
// cannot write the helper's answer, make the daemon run it twice, or
// name a local path; a helper it replaced is held to the protocol.

// attackChannel is the shell a hostile command runs against the channel
// of its exchange: it prints frames that say the push failed, then writes
// them to the stdout (the channel) of the exchange helper of its checkout
// (found by the state directory its command line names: the command runs
// under the holder, not under the helper), and opens its memory (only its
// own: the tests of the suite run side by side as one user). What it
// managed goes to the file attack.
const attackChannel = `F='P\000\000\000\013{"code":91}Z\000\000\000\000'
printf "$F"
n=0; x=exch; x="${x}ange"
for c in $(grep -las -e "/sandboxd-helper-[^/]*.$x.-state.$PWD/.git/sandboxd." /proc/[0-9]*/cmdline); do
	d=${c%/cmdline}; n=$((n+1))
	if printf "$F" >$d/fd/1 2>/dev/null; then echo "wrote $d/fd/1" >>attack; fi
	if (exec 3<$d/mem) 2>/dev/null; then echo "opened $d/mem" >>attack; fi
done
echo "tried $n" >>attack
`

// A command that prints the protocol's frames, writes them into the
// channel through /proc and opens the helper's memory gets nowhere: it
// runs once, its output reaches the caller as it printed it, and its exit
// status is its own.
func TestCommandCannotWriteTheHelpersAnswer(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "runs\nattack\n"})
	if _, err := exec.LookPath("setpriv"); err != nil && os.Geteuid() == 0 {
		t.Skip("running as root without setpriv to drop CAP_SYS_PTRACE")
	}
	ctx := context.Background()
	p, err := f.s.Prepare(ctx, f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	// The holder (the helper's server, or a keeper) runs the command: it
	// too runs without CAP_SYS_PTRACE, as the agent runs a sandbox's
	// commands.
	x, ok, err := f.s.Fuse(ctx, f.r, p, unprivilegedCommand("echo ran >>runs\n"+attackChannel+"exit 7"))
	if err != nil || !ok {
		t.Fatalf("fuse: %v %v", ok, err)
	}
	var out bytes.Buffer
	err = x.Run(ctx, unprivileged{f.r}, ExchangeIO{Stdout: &out, Stderr: io.Discard})
	fr, ferr := x.Finish(ctx, f.r)
	stdout := out.String()
	if err == nil {
		err = ferr
	}
	if err != nil {
		t.Fatalf("the exchange: %+v %v", fr, err)
	}
	if got := string(fileBytes(t, filepath.Join(f.sandbox, "attack"))); got != "tried 1\n" {
		t.Fatalf("the command reached the helper: %q", got)
	}
	if n := runs(t, f); n != 1 || !fr.Ran || fr.ExitCode != 7 {
		t.Fatalf("the command ran %d times, result %+v", n, fr)
	}
	if want := "P\x00\x00\x00\x0b{\"code\":91}Z\x00\x00\x00\x00"; stdout != want {
		t.Fatalf("stdout %q, want %q", stdout, want)
	}
}

// unprivileged runs the exchange as the agent runs a sandbox's commands
// (for the tests that may run as root): without CAP_SYS_PTRACE, which
// opens any process's /proc files.
type unprivileged struct{ Runner }

// unprivilegedCommand is command run without CAP_SYS_PTRACE.
func unprivilegedCommand(command string) string {
	return "exec setpriv --bounding-set=-sys_ptrace sh -c " + shellWord(command)
}

func (u unprivileged) Run(ctx context.Context, command string, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	return u.Runner.Run(ctx, unprivilegedCommand(command), stdin, stdout, stderr)
}

// A command that kills the helper (its parent) leaves the daemon without
// the command's status: the exec ends with an error that says the command
// may have completed, and nothing is sent again.
func TestCommandThatKillsTheHelperIsNotRunAgain(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "runs\n"})
	before := f.r.calls()
	_, _, fr, err := exchange(t, f, "echo ran >>runs; echo edit >b.txt; kill -KILL $PPID; sleep 0.2", nil)
	if err == nil || !errors.Is(err, ErrTransfer) || !strings.Contains(err.Error(), "may or may not have completed") || fr.Ran {
		t.Fatalf("the exchange: %+v %v", fr, err)
	}
	if n := f.r.calls() - before; n != 1 {
		t.Fatalf("%d runner calls, want the exchange alone", n)
	}
	if n := runs(t, f); n != 1 {
		t.Fatalf("the command ran %d times, want once", n)
	}
	// Its edits come back with the next exec.
	if _, fr, err := f.fused("true"); err != nil || !fr.Ran {
		t.Fatalf("the next exec: %+v %v", fr, err)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "b.txt"))); got != "edit\n" {
		t.Fatalf("b.txt = %q", got)
	}
}

// frame is one answer frame, as a helper writes it.
func frame(typ byte, v any) []byte {
	var payload []byte
	switch p := v.(type) {
	case nil:
	case []byte:
		payload = p
	default:
		payload, _ = json.Marshal(v)
	}
	b := []byte{typ, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(b[1:], uint32(len(payload)))
	return append(b, payload...)
}

// dataFrame is a data frame from offset off.
func dataFrame(typ byte, off int64, data string) []byte {
	p := make([]byte, 8, 8+len(data))
	binary.BigEndian.PutUint64(p, uint64(off))
	return frame(typ, append(p, data...))
}

// tagged is frames as a helper that read the exchange's hello and request
// writes them: each tagged under x's key, in order. A frame that does not
// parse (a header over the bound) goes as it is.
func tagged(x *Exchange, frames [][]byte) []byte {
	return taggedWith(x.key, frames)
}

// taggedWith is frames tagged under key; a frame that does not parse
// goes as it is.
func taggedWith(key []byte, frames [][]byte) []byte {
	var b bytes.Buffer
	fw := &helperproto.FrameWriter{W: &b, Key: key}
	for _, f := range frames {
		typ, p, err := (&helperproto.FrameReader{R: bytes.NewReader(f)}).Next()
		if err != nil {
			b.Write(f)
			continue
		}
		_ = fw.Write(typ, p)
	}
	return b.Bytes()
}

// replaceHelper replaces f's helper binary by a script that runs prefix,
// then prints answer.
func replaceHelper(t *testing.T, f *fixture, prefix string, answer []byte) {
	t.Helper()
	bin := filepath.Join(f.sandbox, ".git", "sandboxd", "bin", f.r.helperName)
	if err := os.Remove(bin); err != nil {
		t.Fatal(err)
	}
	writeFile(t, bin, "#!/bin/sh\n[ \"$1\" = exchange ] || exit 2\n"+prefix+"printf '"+octal(answer)+"'\n")
	if err := os.Chmod(bin, 0o755); err != nil {
		t.Fatal(err)
	}
}

// octal is b as printf's format, every byte escaped.
func octal(b []byte) string {
	var s strings.Builder
	for _, c := range b {
		fmt.Fprintf(&s, "\\%03o", c)
	}
	return s.String()
}

// A command that replaces the helper's binary controls the next exec's
// answers: the daemon holds them to the protocol. A report that nothing
// ran after the start, an exit status out of range, output that goes back,
// a frame over the bound, or a pull whose id is a path: each ends the exec
// with an error; nothing is sent again and no local file is named.
func TestReplacedHelperIsHeldToTheProtocol(t *testing.T) {
	withHelper(t)
	hello := frame(helperproto.FrameHelloAnswer, helperproto.HelloAnswer{Version: helperproto.Version})
	started := frame(helperproto.FrameStarted, helperproto.Started{})
	cases := map[string][][]byte{
		"declined after the start":    {hello, started, frame(helperproto.FrameDeclined, helperproto.Declined{Reason: "run me again"})},
		"push failed after the start": {hello, started, frame(helperproto.FramePushFailed, helperproto.PushFailed{Code: 91})},
		"exit status out of range":    {hello, started, frame(helperproto.FrameExit, helperproto.Exit{Code: 300})},
		"output that goes back":       {hello, started, dataFrame(helperproto.FrameStdout, 0, "one"), dataFrame(helperproto.FrameStdout, 1, "again")},
		"a frame over the bound":      {hello, started, {helperproto.FrameStdout, 0x7f, 0xff, 0xff, 0xff}},
		"a pull named by a path": {hello, started, frame(helperproto.FrameExit, helperproto.Exit{}),
			frame(helperproto.FramePull, []byte("sandboxd-pull /../../../victim 99999999999\n")),
			frame(helperproto.FramePullEnd, helperproto.PullEnd{TooLarge: true}), frame(helperproto.FrameEnd, nil)},
	}
	for name, frames := range cases {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "runs\n"})
			if _, fr, err := f.fused("true"); err != nil || !fr.Ran {
				t.Fatalf("first exec: %+v %v", fr, err)
			}
			victim := filepath.Join(filepath.Dir(f.local), "victim")
			writeFile(t, victim, "the user's\n")
			var before int
			_, _, fr, err := exchangeAfter(t, f, "echo ran >>runs", nil, func(x *Exchange) {
				// The command's doing, as any command of the sandbox's
				// user can: the next exchange runs this instead of the
				// helper, which reads the hello and the request as the
				// helper does, so its frames carry the tags.
				replaceHelper(t, f, "echo ran >>runs\n", tagged(x, frames))
				before = f.r.calls()
			})
			t.Logf("%+v %v", fr, err)
			if err == nil && fr.PullErr == nil {
				t.Fatalf("the replaced helper's answer was taken: %+v", fr)
			}
			if name != "a pull named by a path" && !errors.Is(err, ErrForgedReport) {
				t.Fatalf("not refused as a broken protocol: %v", err)
			}
			if n := f.r.calls() - before; n > 1 && name != "a pull named by a path" {
				t.Fatalf("%d runner calls: the exchange was sent again", n)
			}
			if n := runs(t, f); n != 1 {
				t.Fatalf("the command ran %d times, want once: %q", n, fileBytes(t, filepath.Join(f.sandbox, "runs")))
			}
			if got := string(fileBytes(t, victim)); got != "the user's\n" {
				t.Fatalf("a local file named by the sandbox was written: %q", got)
			}
		})
	}
}

// A helper that speaks none of the daemon's versions (it answers version
// 0) takes nothing: the exec takes the separate steps, and the command
// runs once.
func TestHelperOfAnotherVersionLeavesTheSeparateSteps(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "runs\n"})
	if _, fr, err := f.fused("true"); err != nil || !fr.Ran {
		t.Fatalf("first exec: %+v %v", fr, err)
	}
	writeFile(t, filepath.Join(f.local, "a.txt"), "local\n")
	out, fr, err := f.fusedAfter("echo ran >>runs; cat a.txt", func(x *Exchange) {
		replaceHelper(t, f, "", tagged(x, [][]byte{frame(helperproto.FrameHelloAnswer, helperproto.HelloAnswer{Version: 0})}))
	})
	if err != nil || !fr.Ran || out != "local\n" {
		t.Fatalf("exec: %q %+v %v", out, fr, err)
	}
	if n := runs(t, f); n != 1 {
		t.Fatalf("the command ran %d times, want once", n)
	}
}

package gitsync

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/internal/helperproto"
	"github.com/sandboxd/sandboxd/internal/testutil"
	"time"
)

// withHelper makes the fixtures of t run the sandbox helper.
func withHelper(t *testing.T) {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("the sandbox helper runs in Linux sandboxes")
	}
	useHelper = true
	t.Cleanup(func() { useHelper = false })
}

// exchange runs command as one exchange with the helper on f, with stdin,
// and returns its stdout, its stderr and what Finish said.
func exchange(t *testing.T, f *fixture, command string, stdin io.Reader) (string, string, Fused, error) {
	t.Helper()
	return exchangeAfter(t, f, command, stdin, nil)
}

// exchangeAfter is exchange with before called on the exchange once it is
// made, before it runs.
func exchangeAfter(t *testing.T, f *fixture, command string, stdin io.Reader, before func(*Exchange)) (string, string, Fused, error) {
	t.Helper()
	ctx := context.Background()
	p, err := f.s.PrepareExchange(ctx, f.r, f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	p.Sandbox = "fixture"
	x, ok, err := f.s.Fuse(ctx, f.r, p, command)
	if err != nil || !ok {
		t.Fatalf("fuse: %v %v", ok, err)
	}
	if before != nil {
		before(x)
	}
	var stdout, stderr bytes.Buffer
	runErr := x.Run(ctx, f.r, ExchangeIO{Stdin: stdin, Stdout: &stdout, Stderr: &stderr})
	fr, err := x.Finish(ctx, f.r)
	if err == nil {
		err = runErr
	}
	return stdout.String(), stderr.String(), fr, err
}

// The command's output reaches the caller byte for byte, stdout and stderr
// apart, including output that looks like the protocol's frames and output
// without a final newline; its exit status is its own.
func TestExchangeOutputPassesThroughExactly(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	writeFile(t, filepath.Join(f.local, "a.txt"), "local\n")
	command := `printf 'X\000\000\000\014{"code":0}Z\000\000\000\000'; cat a.txt; printf 'E\000\000\000\011\000\000\000\000\000\000\000\000e' >&2; printf 'no newline\036'; exit 7`
	stdout, stderr, fr, err := exchange(t, f, command, nil)
	if err != nil {
		t.Fatal(err)
	}
	if want := "X\x00\x00\x00\x0c{\"code\":0}Z\x00\x00\x00\x00local\nno newline\x1e"; stdout != want {
		t.Fatalf("stdout %q, want %q", stdout, want)
	}
	if want := "E\x00\x00\x00\x09\x00\x00\x00\x00\x00\x00\x00\x00e"; stderr != want {
		t.Fatalf("stderr %q, want %q", stderr, want)
	}
	if !fr.Ran || fr.ExitCode != 7 {
		t.Fatalf("result %+v", fr)
	}
}

// The command reads the caller's stdin, which travels in frames after the
// request.
func TestExchangeStdinReachesTheCommand(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	writeFile(t, filepath.Join(f.local, "a.txt"), "patched\n")
	stdout, _, fr, err := exchange(t, f, "cat >from-stdin.txt; cat a.txt", strings.NewReader("typed\n"))
	if err != nil || fr.PullErr != nil {
		t.Fatalf("exchange: %v %v", err, fr.PullErr)
	}
	if stdout != "patched\n" {
		t.Fatalf("stdout %q", stdout)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "from-stdin.txt"))); got != "typed\n" {
		t.Fatalf("pulled from-stdin.txt = %q", got)
	}
}

// A command killed by a signal still has its edits pulled, and the
// exchange reports the signal by name.
func TestExchangeCommandKilledBySignalIsStillPulled(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	_, fr, err := f.fused(`echo edited > a.txt; kill -TERM $$; echo never`)
	if err != nil || fr.PullErr != nil {
		t.Fatalf("exec: %v %v", err, fr.PullErr)
	}
	if fr.ExitCode != 128+15 || fr.Signal != "TERM" {
		t.Fatalf("exit %d signal %q, want 143 TERM", fr.ExitCode, fr.Signal)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "a.txt"))); got != "edited\n" {
		t.Fatalf("a.txt = %q", got)
	}
}

// The user's command sees none of the exchange's shell variables, nor the
// PATH the sync adds.
func TestExchangeCommandGetsAPristineShell(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	t.Setenv("PATH", "/usr/bin:/bin")
	out, _, err := f.fused(`echo "[$st][$gd][$snap][$H][$HI][$PATH]"; command -v g || echo no-g`)
	if err != nil {
		t.Fatal(err)
	}
	if out != "[][][][][][/usr/bin:/bin]\nno-g\n" {
		t.Fatalf("the command saw %q", out)
	}
}

// A push that fails is reported as the push's error and the command never
// runs, with the helper (its exec fails before it starts: the separate
// steps say why) and without.
func TestFusedPushFailureRunsNothing(t *testing.T) {
	for _, helper := range []bool{false, true} {
		t.Run(fmt.Sprintf("helper=%v", helper), func(t *testing.T) {
			if helper {
				withHelper(t)
			}
			f := newFixture(t, map[string]string{"a.txt": "a\n"})
			if err := os.RemoveAll(filepath.Join(f.sandbox, ".git")); err != nil {
				t.Fatal(err)
			}
			_, fr, err := f.fused("touch ran")
			if !errors.Is(err, ErrNoGitDir) || !errors.Is(err, errdefs.ErrGone) || fr.Ran {
				t.Fatalf("exec: %+v %v", fr, err)
			}
			if _, err := os.Stat(filepath.Join(f.sandbox, "ran")); !os.IsNotExist(err) {
				t.Fatalf("the command ran: %v", err)
			}
		})
	}
}

// A sandbox without the local HEAD gets it by git push first; then the
// exchange runs the command.
func TestFusedPushesUnknownCommitsFirst(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	writeFile(t, filepath.Join(f.local, "b.txt"), "b\n")
	testutil.Git(t, f.local, "add", "b.txt")
	testutil.Git(t, f.local, "commit", "-q", "-m", "not pushed")
	out, fr, err := f.fused("cat b.txt")
	if err != nil || out != "b\n" || !fr.Push.Commits {
		t.Fatalf("exec: %q %+v %v", out, fr, err)
	}
}

// Edits of an earlier exec that were never pulled come back before the
// command runs.
func TestFusedBringsBackUnpulledEditsFirst(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	f.push()
	f.inSandbox("echo lost > lost.txt")
	out, fr, err := f.fused("cat lost.txt")
	if err != nil {
		t.Fatal(err)
	}
	if out != "lost\n" {
		t.Fatalf("the command saw %q", out)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "lost.txt"))); got != "lost\n" {
		t.Fatalf("lost.txt = %q", got)
	}
	_ = fr
}

// The request travels on the exec's stdin, not in its command line: a
// patch over what one argument may hold still takes one exchange.
func TestExchangeCarriesALargePatch(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	writeFile(t, filepath.Join(f.local, "big.txt"), strings.Repeat("0123456789abcdef\n", 16<<10))
	out, fr, err := f.fused("wc -c <big.txt")
	if err != nil || !fr.Ran || strings.TrimSpace(out) != fmt.Sprint(17*16<<10) {
		t.Fatalf("exec: %q %+v %v", out, fr, err)
	}
	if n := f.r.calls(); n != 1 {
		t.Fatalf("the exec made %d runner calls, want 1", n)
	}
}

// Without a helper there is no exchange: the separate steps.
func TestFuseWithoutAHelperTakesTheSeparateSteps(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	p, err := f.s.Prepare(context.Background(), f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok, err := f.s.Fuse(context.Background(), f.r, p, "true"); ok || err != nil {
		t.Fatalf("fused without a helper: %v %v", ok, err)
	}
}

// When the pull part of the answer arrives damaged (here its end is
// lost), the pull is fetched again and nothing is lost.
func TestExchangeDamagedPullIsFetchedAgain(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	ctx := context.Background()
	p, err := f.s.Prepare(ctx, f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	x, _, err := f.s.Fuse(ctx, f.r, p, "echo new > new.txt; echo done")
	if err != nil {
		t.Fatal(err)
	}
	var stdout bytes.Buffer
	drop := &frameFilter{Runner: f.r, drop: func(typ byte) bool { return typ == helperproto.FramePullEnd || typ == helperproto.FrameEnd }}
	_ = x.Run(ctx, drop, ExchangeIO{Stdout: &stdout})
	before := f.r.calls()
	fr, err := x.Finish(ctx, f.r)
	if err != nil || fr.PullErr != nil || !fr.Ran {
		t.Fatalf("finish: %+v %v", fr, err)
	}
	if f.r.calls() != before+1 {
		t.Fatalf("the pull was not fetched again")
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "new.txt"))); got != "new\n" {
		t.Fatalf("new.txt = %q", got)
	}
	if stdout.String() != "done\n" {
		t.Fatalf("stdout %q", stdout.String())
	}
}

// frameFilter runs commands on Runner and drops the answer frames drop
// names from their stdout, as a broken transfer or a hostile helper would.
type frameFilter struct {
	Runner
	drop func(typ byte) bool
}

func (ff *frameFilter) Run(ctx context.Context, command string, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	pr, pw := io.Pipe()
	done := make(chan struct{})
	go func() {
		defer close(done)
		fr := &helperproto.FrameReader{R: pr}
		fw := &helperproto.FrameWriter{W: stdout}
		for {
			typ, p, err := fr.Next()
			if err != nil {
				_, _ = io.Copy(io.Discard, pr)
				return
			}
			if !ff.drop(typ) {
				_ = fw.Write(typ, p)
			}
		}
	}()
	code, err := ff.Runner.Run(ctx, command, stdin, pw, stderr)
	pw.Close()
	<-done
	return code, err
}

// gitLog puts a git on the PATH that records its directory and subcommand
// in the returned file before running the real one.
func gitLog(t *testing.T) string {
	t.Helper()
	real, err := exec.LookPath("git")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	log := filepath.Join(dir, "calls")
	writeFile(t, filepath.Join(dir, "git"), "#!/bin/sh\nfor a; do case $a in -c) skip=1;; *) if [ -n \"$skip\" ]; then skip=; else echo \"$PWD $a\" >>"+log+"; break; fi;; esac; done\nexec "+real+" \"$@\"\n")
	if err := os.Chmod(filepath.Join(dir, "git"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", dir+":"+os.Getenv("PATH"))
	return log
}

// sandboxCalls are the git subcommands gitLog's log recorded in dir.
func sandboxCalls(t *testing.T, log, dir string) []string {
	t.Helper()
	var calls []string
	for _, line := range strings.Split(string(fileBytes(t, log)), "\n") {
		if d, c, ok := strings.Cut(line, " "); ok && d == dir {
			calls = append(calls, c)
		}
	}
	return calls
}

// secondExec runs an exec whose command leaves a file the local side then
// removes, then a second exec with a local edit, and returns the fixture
// and the git subcommands the second one ran in the sandbox.
func secondExec(t *testing.T) (*fixture, []string) {
	t.Helper()
	f := newFixture(t, map[string]string{"a.txt": "a\n", "b.txt": "b\n"})
	writeFile(t, filepath.Join(f.local, "a.txt"), "one\n")
	if _, _, err := f.exec("echo left > left.txt"); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(f.local, "left.txt")); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(f.local, "a.txt"), "two\n")
	log := gitLog(t)
	out, _, err := f.exec("cat a.txt; ls")
	if err != nil {
		t.Fatal(err)
	}
	if out != "two\na.txt\nb.txt\n" {
		t.Fatalf("the command saw %q", out)
	}
	calls := sandboxCalls(t, log, f.sandbox)
	return f, calls
}

// A push moves the sandbox's tree to the new one like a checkout: one scan
// of the working tree (git add), no reset and no clean; a file the command
// left behind is still removed.
func TestFusedPushScansOnce(t *testing.T) {
	_, calls := secondExec(t)
	for _, c := range calls {
		if c == "reset" || c == "clean" {
			t.Fatalf("the push ran git %s: %v", c, calls)
		}
	}
	if n := strings.Count(" "+strings.Join(calls, " ")+" ", " add "); n != 2 {
		t.Fatalf("%d scans (git add), want 2 (push and pull): %v", n, calls)
	}
}

// An ignored file in the sandbox where the new tree has a tracked one (the
// local .gitignore changed) is replaced by the local file.
func TestFusedPushReplacesAnIgnoredFileInTheWay(t *testing.T) {
	f := newFixture(t, map[string]string{".gitignore": "gen/\n", "a.txt": "a\n"})
	if _, _, err := f.exec("mkdir -p gen && echo generated > gen/x"); err != nil {
		t.Fatal(err)
	}
	// Locally gen/ is no longer ignored and gen/x is a source file.
	writeFile(t, filepath.Join(f.local, ".gitignore"), "")
	writeFile(t, filepath.Join(f.local, "gen", "x"), "source\n")
	out, _, err := f.exec("cat gen/x")
	if err != nil {
		t.Fatal(err)
	}
	if out != "source\n" {
		t.Fatalf("the command saw %q", out)
	}
}

// An exec run again with nothing changed (the command's edits of the last
// exec already here) builds no scratch tree and moves no file: the tree of
// the same patch on the same head is remembered, and a working tree that
// already holds it is left as it is (with the helper, the user's index is
// not rewritten either). The sandbox still ends up as a synced exec leaves
// it.
func TestFusedExecAgainWithNothingChangedMovesNothing(t *testing.T) {
	for _, helper := range []bool{false, true} {
		t.Run(fmt.Sprintf("helper=%v", helper), func(t *testing.T) {
			useHelper = helper
			t.Cleanup(func() { useHelper = false })
			f := newFixture(t, map[string]string{"a.txt": "a\n", "b.txt": "b\n"})
			writeFile(t, filepath.Join(f.local, "a.txt"), "local\n")
			if _, _, err := f.exec("echo made > made.txt"); err != nil {
				t.Fatal(err)
			}
			// The pulled edit is now local too: the sandbox already holds
			// the tree the next push asks for.
			if _, _, err := f.exec("true"); err != nil {
				t.Fatal(err)
			}
			log := gitLog(t)
			out, _, err := f.exec("cat a.txt made.txt")
			if err != nil {
				t.Fatal(err)
			}
			if out != "local\nmade\n" {
				t.Fatalf("the command saw %q", out)
			}
			calls := sandboxCalls(t, log, f.sandbox)
			joined := " " + strings.Join(calls, " ") + " "
			for _, c := range []string{"apply", "reset", "clean"} {
				if strings.Contains(joined, " "+c+" ") {
					t.Fatalf("git %s ran for an exec with nothing changed: %v", c, calls)
				}
			}
			// Without the helper the one read-tree is the user's index.
			want := 1
			if helper {
				want = 0
			}
			if n := strings.Count(joined, " read-tree "); n != want {
				t.Fatalf("%d read-tree, want %d: %v", n, want, calls)
			}
			// A different head with the same patch is not taken for it.
			writeFile(t, filepath.Join(f.local, "c.txt"), "c\n")
			testutil.Git(t, f.local, "add", "c.txt")
			testutil.Git(t, f.local, "commit", "-q", "-m", "c")
			f.base = strings.TrimSpace(testutil.Git(t, f.local, "rev-parse", "HEAD"))
			if out, _, err := f.exec("cat a.txt c.txt made.txt"); err != nil || out != "local\nc\nmade\n" {
				t.Fatalf("after a commit: %q %v", out, err)
			}
			f.pushAndCompare()
		})
	}
}

// In a large tree the push moves the sandbox's working tree by a patch of
// what differs (diff-tree, then apply --index): no two-way read-tree and
// no full reset (the one read-tree left resets the user's index).
func TestFusedPushInALargeTreeAppliesWhatDiffers(t *testing.T) {
	largeTree = true
	t.Cleanup(func() { largeTree = false })
	_, calls := secondExec(t)
	count := func(sub string) (n int) {
		for _, c := range calls {
			if c == sub {
				n++
			}
		}
		return n
	}
	if count("diff-tree") != 1 || count("apply") != 2 || count("read-tree") != 1 || count("reset") != 0 {
		t.Fatalf("the move was not one patch of what differs (want diff-tree 1, apply 2, read-tree 1): %v", calls)
	}
}

// slowExit runs commands on Runner and returns delay after they ended, as
// an agent slow to report a process's exit would; returned is closed then.
type slowExit struct {
	Runner
	delay    time.Duration
	returned chan struct{}
}

func (s *slowExit) Run(ctx context.Context, command string, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	code, err := s.Runner.Run(ctx, command, stdin, stdout, stderr)
	defer close(s.returned)
	select {
	case <-time.After(s.delay):
	case <-ctx.Done():
	}
	return code, err
}

// An exchange whose helper sent its End frame returns without waiting for
// the helper's process to end: its output, status and pull are whole, and
// the exec request ends by itself after.
func TestExchangeReturnsAtItsEndWithoutWaitingForTheHelpersExit(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	if _, _, fr, err := exchange(t, f, "true", nil); err != nil || !fr.Ran {
		t.Fatalf("first exec: %+v %v", fr, err)
	}
	writeFile(t, filepath.Join(f.local, "a.txt"), "local\n")
	ctx := context.Background()
	p, err := f.s.PrepareExchange(ctx, f.r, f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	p.Sandbox = "fixture"
	x, ok, err := f.s.Fuse(ctx, f.r, p, "cat a.txt; echo made > made.txt; exit 3")
	if err != nil || !ok {
		t.Fatalf("fuse: %v %v", ok, err)
	}
	slow := &slowExit{Runner: f.r, delay: 3 * time.Second, returned: make(chan struct{})}
	var stdout bytes.Buffer
	began := time.Now()
	if err := x.Run(ctx, slow, ExchangeIO{Stdout: &stdout, Stderr: io.Discard}); err != nil {
		t.Fatal(err)
	}
	took := time.Since(began)
	fr, err := x.Finish(ctx, f.r)
	if err != nil || !fr.Ran || fr.ExitCode != 3 || stdout.String() != "local\n" {
		t.Fatalf("the exchange: stdout %q, %+v, %v", stdout.String(), fr, err)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "made.txt"))); got != "made\n" {
		t.Fatalf("made.txt on the laptop: %q", got)
	}
	if took > time.Second {
		t.Fatalf("Run took %s: it waited for the helper's process to end after its End frame", took)
	}
	select {
	case <-slow.returned:
	case <-time.After(10 * time.Second):
		t.Fatal("the exec request did not end by itself after the exchange")
	}
}

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
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/internal/testutil"
)

// The command's output reaches the caller byte for byte, stdout and stderr
// apart, however it is cut into writes, and the trailer never shows:
// including output that looks like the start of the boundary, and output
// without a final newline.
func TestFusedOutputPassesThroughExactly(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	writeFile(t, filepath.Join(f.local, "a.txt"), "local\n")
	ctx := context.Background()
	p, err := f.s.Prepare(ctx, f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	x, ok, err := f.s.Fuse(ctx, f.r, p, `printf '\036sandboxd-x\n'; cat a.txt; printf 'err\n' >&2; printf 'no newline\036'; exit 7`)
	if err != nil || !ok {
		t.Fatalf("fuse: %v %v", ok, err)
	}
	var stdout, stderr bytes.Buffer
	code, err := f.r.Run(ctx, x.Command(), nil, &oneByteWriter{w: x.Stdout(&stdout)}, &stderr)
	if err != nil {
		t.Fatal(err)
	}
	fr, err := x.Finish(ctx, f.r)
	if err != nil {
		t.Fatal(err)
	}
	if want := "\x1esandboxd-x\nlocal\nno newline\x1e"; stdout.String() != want {
		t.Fatalf("stdout %q, want %q", stdout.String(), want)
	}
	if stderr.String() != "err\n" {
		t.Fatalf("stderr %q", stderr.String())
	}
	if code != 7 || !fr.Ran || fr.ExitCode != 7 {
		t.Fatalf("exit %d, result %+v", code, fr)
	}
}

// oneByteWriter cuts every write into single bytes, as a slow network may.
type oneByteWriter struct{ w io.Writer }

func (o *oneByteWriter) Write(p []byte) (int, error) {
	for i := range p {
		if _, err := o.w.Write(p[i : i+1]); err != nil {
			return i, err
		}
	}
	return len(p), nil
}

// The command reads the caller's stdin; the patch travels in the command.
func TestFusedStdinReachesTheCommand(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	writeFile(t, filepath.Join(f.local, "a.txt"), "patched\n")
	ctx := context.Background()
	p, err := f.s.Prepare(ctx, f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	x, _, err := f.s.Fuse(ctx, f.r, p, "cat >from-stdin.txt; cat a.txt")
	if err != nil {
		t.Fatal(err)
	}
	var stdout bytes.Buffer
	if _, err := f.r.Run(ctx, x.Command(), strings.NewReader("typed\n"), x.Stdout(&stdout), io.Discard); err != nil {
		t.Fatal(err)
	}
	fr, err := x.Finish(ctx, f.r)
	if err != nil || fr.PullErr != nil {
		t.Fatalf("finish: %v %v", err, fr.PullErr)
	}
	if stdout.String() != "patched\n" {
		t.Fatalf("stdout %q", stdout.String())
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "from-stdin.txt"))); got != "typed\n" {
		t.Fatalf("pulled from-stdin.txt = %q", got)
	}
}

// A command killed by a signal still has its edits pulled, and the
// exchange ends by the same signal.
func TestFusedCommandKilledBySignalIsStillPulled(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	_, fr, err := f.fused(`echo edited > a.txt; kill -TERM $$; echo never`)
	if err != nil || fr.PullErr != nil {
		t.Fatalf("exec: %v %v", err, fr.PullErr)
	}
	if fr.ExitCode != 128+15 {
		t.Fatalf("exit %d, want 143", fr.ExitCode)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "a.txt"))); got != "edited\n" {
		t.Fatalf("a.txt = %q", got)
	}
	g := newFixture(t, map[string]string{"a.txt": "a\n"})
	var out bytes.Buffer
	code, err := g.r.Run(context.Background(), fusedScript("", newNonce(), g.base, nil, "", false, f.s.now(), "", nil, 1<<20, false, "kill -INT $$"), nil, &out, &out)
	if err != nil || code != -1 {
		t.Fatalf("the exchange ended with %d (%v), want a signal; output %q", code, err, out.String())
	}
}

// The user's command sees neither the wrapper's variables and functions
// nor the PATH the sync adds.
func TestFusedCommandGetsAPristineShell(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	t.Setenv("PATH", "/usr/bin:/bin")
	out, _, err := f.fused(`echo "[$st][$gd][$snap][$N][$PATH]"; command -v g || echo no-g`)
	if err != nil {
		t.Fatal(err)
	}
	if out != "[][][][][/usr/bin:/bin]\nno-g\n" {
		t.Fatalf("the command saw %q", out)
	}
}

// A push that fails is reported as the push's error and the command never
// runs.
func TestFusedPushFailureRunsNothing(t *testing.T) {
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

// A patch over the bound, or one a here-document cannot carry, takes the
// separate steps.
func TestFusedLargePatchIsNotFused(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	writeFile(t, filepath.Join(f.local, "big.txt"), strings.Repeat("0123456789abcdef\n", MaxFusedPatch/16))
	p, err := f.s.Prepare(context.Background(), f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok, err := f.s.Fuse(context.Background(), f.r, p, "true"); ok || err != nil {
		t.Fatalf("fused a %d-byte patch: %v", len(p.Data), err)
	}
	nonce := newNonce()
	for _, patch := range []string{"a\x00b\n", "no newline", "x\n" + heredocWord(nonce) + "\ny\n", heredocWord(nonce) + "\n"} {
		if fusable([]byte(patch), nonce) {
			t.Fatalf("%q is fusable", patch)
		}
	}
}

// When the pull part of the trailer arrives damaged (the connection broke,
// a background process wrote into it), the pull is fetched again and
// nothing is lost.
func TestFusedDamagedTrailerPullsAgain(t *testing.T) {
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
	if _, err := f.r.Run(ctx, x.Command(), nil, &truncatingWriter{w: x.Stdout(&stdout), after: []byte("exit 0\n"), keep: 20}, io.Discard); err != nil {
		t.Fatal(err)
	}
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

// truncatingWriter passes keep bytes after the first occurrence of after,
// then drops the rest.
type truncatingWriter struct {
	w     io.Writer
	after []byte
	keep  int
	seen  []byte
}

func (tw *truncatingWriter) Write(p []byte) (int, error) {
	start := len(tw.seen)
	tw.seen = append(tw.seen, p...)
	i := bytes.Index(tw.seen, tw.after)
	if i < 0 {
		return tw.w.Write(p)
	}
	limit := i + len(tw.after) + tw.keep
	if start >= limit {
		return len(p), nil
	}
	n := min(len(p), limit-start)
	if _, err := tw.w.Write(p[:n]); err != nil {
		return 0, err
	}
	return len(p), nil
}

// The trailer writer finds its mark across writes of any size and holds
// back only what may begin it.
func TestTrailerWriterSplitsAtTheMark(t *testing.T) {
	mark := []byte("\x1esandboxd-abc\n")
	in := "out\x1esand\x1e\x1esandboxd-ab" + string(mark) + "push 0\n"
	for size := 1; size <= len(in); size++ {
		var out bytes.Buffer
		tw := &trailerWriter{w: &out, mark: mark, trailer: limitedBuffer{max: 1 << 10, buf: &bytes.Buffer{}}}
		for i := 0; i < len(in); i += size {
			if _, err := tw.Write([]byte(in[i:min(i+size, len(in))])); err != nil {
				t.Fatal(err)
			}
		}
		if !tw.found || out.String() != "out\x1esand\x1e\x1esandboxd-ab" || tw.trailer.buf.String() != "push 0\n" {
			t.Fatalf("size %d: found %v, out %q, trailer %q", size, tw.found, out.String(), tw.trailer.buf.String())
		}
	}
	var out bytes.Buffer
	tw := &trailerWriter{w: &out, mark: mark, trailer: limitedBuffer{max: 1 << 10, buf: &bytes.Buffer{}}}
	_, _ = tw.Write([]byte("tail\x1esandbox"))
	if out.String() != "tail" {
		t.Fatalf("out %q before the end", out.String())
	}
	tw.flush()
	if out.String() != "tail\x1esandbox" {
		t.Fatalf("out %q after flush", out.String())
	}
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

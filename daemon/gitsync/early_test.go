package gitsync

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

// hows records how each Prepare of f's Syncer went (the observe hook).
type hows struct {
	mu  sync.Mutex
	all []string
}

func watchHows(t *testing.T, f *fixture) *hows {
	h := &hows{}
	f.s.observe = func(how string) {
		t.Logf("prepare: %s", how)
		h.mu.Lock()
		h.all = append(h.all, how)
		h.mu.Unlock()
	}
	return h
}

// take returns the hows recorded since the last take.
func (h *hows) take() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := h.all
	h.all = nil
	return out
}

// nativeOff makes the sandbox helper of f decline the native push for
// head (its decline for good), so that every push is the plain one.
func nativeOff(t *testing.T, f *fixture) {
	t.Helper()
	writeFile(t, filepath.Join(f.sandbox, ".git", "sandboxd", "native.off"), f.r.helperInstance+" "+f.base+"\n")
}

// Exec after exec with the helper, through edits, new files, a removal, a
// rename, a mode change, a symbolic link, content back to HEAD's and an
// ignored file, the request leaves before the patch (the early way) and
// the sandbox ends up as the local tree; the Syncer's verify mode checks
// every early request's entries against git's staging and a full scan.
func TestEarlyRequestLeavesTheSandboxAsTheLocalTree(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n", "b.txt": "b\n", "dir/c.txt": "c\n", ".gitignore": "*.log\n"})
	h := watchHows(t, f)
	if _, fr, err := f.fused("true"); err != nil || !fr.Ran {
		t.Fatalf("first exec: ran %v, err %v", fr.Ran, err)
	}
	h.take()
	steps := []struct {
		name   string
		change func()
	}{
		{"edit", func() { writeFile(t, filepath.Join(f.local, "a.txt"), "one\n") }},
		{"new file", func() { writeFile(t, filepath.Join(f.local, "dir/n.txt"), "n\n") }},
		{"edit another, keep the first", func() { writeFile(t, filepath.Join(f.local, "b.txt"), "b two\n") }},
		{"removal", func() { rm(f, "dir/c.txt") }},
		{"rename", func() { mv(f, "b.txt", filepath.Join(f.local, "moved.txt")) }},
		{"mode change", func() {
			if err := os.Chmod(filepath.Join(f.local, "a.txt"), 0o755); err != nil {
				t.Fatal(err)
			}
		}},
		{"symbolic link", func() {
			if err := os.Symlink("a.txt", filepath.Join(f.local, "link")); err != nil {
				t.Fatal(err)
			}
		}},
		{"link retargeted", func() {
			rm(f, "link")
			if err := os.Symlink("dir/n.txt", filepath.Join(f.local, "link")); err != nil {
				t.Fatal(err)
			}
		}},
		{"back to HEAD's content", func() {
			writeFile(t, filepath.Join(f.local, "a.txt"), "a\n")
			if err := os.Chmod(filepath.Join(f.local, "a.txt"), 0o644); err != nil {
				t.Fatal(err)
			}
		}},
		{"ignored file", func() { writeFile(t, filepath.Join(f.local, "x.log"), "log\n") }},
		{"file removed and its name reused by a rename", func() { mv(f, "moved.txt", filepath.Join(f.local, "b.txt")) }},
	}
	for _, st := range steps {
		st.change()
		out, fr, err := f.fused("ls -la >/dev/null; cat a.txt")
		if err != nil || !fr.Ran || fr.ExitCode != 0 {
			t.Fatalf("%s: ran %v, exit %d, err %v, output %q", st.name, fr.Ran, fr.ExitCode, err, out)
		}
		if got := h.take(); len(got) != 1 || got[0] != "early" {
			t.Fatalf("%s: prepared %v, want one early request", st.name, got)
		}
		if want := string(fileBytes(t, filepath.Join(f.local, "a.txt"))); out != want {
			t.Fatalf("%s: the command saw a.txt as %q, want %q", st.name, out, want)
		}
		assertTree(t, f.sandbox, syncedTree(t, f.local))
	}
}

// When the native push declines (here for good, native.off), the helper
// takes the patch from the frame that follows the early request and the
// push script syncs the sandbox to the local tree.
func TestEarlyRequestWhoseNativePushDeclinesTakesThePatchFrame(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n", "b.txt": "b\n"})
	h := watchHows(t, f)
	if _, _, err := f.fused("true"); err != nil {
		t.Fatal(err)
	}
	nativeOff(t, f)
	h.take()
	for i, change := range []func(){
		func() { writeFile(t, filepath.Join(f.local, "a.txt"), "one\n") },
		func() {
			writeFile(t, filepath.Join(f.local, "n.txt"), "n\n")
			rm(f, "b.txt")
		},
	} {
		change()
		out, fr, err := f.fused("cat a.txt")
		if err != nil || !fr.Ran || fr.Native {
			t.Fatalf("exec %d: ran %v, native %v, err %v", i, fr.Ran, fr.Native, err)
		}
		if got := h.take(); len(got) != 1 || got[0] != "early" {
			t.Fatalf("exec %d: prepared %v, want one early request", i, got)
		}
		if want := string(fileBytes(t, filepath.Join(f.local, "a.txt"))); out != want {
			t.Fatalf("exec %d: the command saw a.txt as %q, want %q", i, out, want)
		}
		assertTree(t, f.sandbox, syncedTree(t, f.local))
	}
}

// Where git stores a file otherwise than as it is (an attribute that
// normalizes line ends, core.autocrlf), the request waits for the patch
// and the sandbox gets what git stored.
func TestEarlyRequestNotTakenWhereGitConvertsFiles(t *testing.T) {
	withHelper(t)
	for _, c := range []struct {
		name  string
		files map[string]string
		setup func(f *fixture)
	}{
		{"text attribute", map[string]string{".gitattributes": "*.txt text\n", "a.txt": "a\n"}, nil},
		{"attribute in a subdirectory", map[string]string{"sub/.gitattributes": "*.txt text\n", "sub/a.txt": "a\n", "a.txt": "a\n"}, nil},
		{"core.autocrlf", map[string]string{"a.txt": "a\n"}, func(f *fixture) {
			testutil.Git(t, f.local, "config", "core.autocrlf", "true")
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, c.files)
			if c.setup != nil {
				c.setup(f)
			}
			h := watchHows(t, f)
			if _, _, err := f.fused("true"); err != nil {
				t.Fatal(err)
			}
			h.take()
			name := "a.txt"
			if _, ok := c.files["sub/a.txt"]; ok {
				name = "sub/a.txt"
			}
			for i, text := range []string{"one\r\n", "two\r\n"} {
				writeFile(t, filepath.Join(f.local, name), text)
				if _, fr, err := f.fused("true"); err != nil || !fr.Ran {
					t.Fatalf("exec %d: ran %v, err %v", i, fr.Ran, err)
				}
				for _, how := range h.take() {
					if how == "early" {
						t.Fatalf("exec %d: an early request where git converts files", i)
					}
				}
				want := strings.ReplaceAll(text, "\r\n", "\n")
				if got := string(fileBytes(t, filepath.Join(f.sandbox, name))); got != want {
					t.Fatalf("exec %d: the sandbox's %s is %q, want %q (what git stored)", i, name, got, want)
				}
			}
		})
	}
}

// failingGit is a git that fails the first diff after mark is created
// (and removes mark), as a git that breaks behind an early request.
func failingGit(t *testing.T) (bin, mark string) {
	t.Helper()
	real, err := exec.LookPath("git")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	bin, mark = filepath.Join(dir, "git"), filepath.Join(dir, "fail-next-diff")
	script := `#!/bin/sh
if [ -e '` + mark + `' ]; then
	for a in "$@"; do
		if [ "$a" = diff ]; then rm -f '` + mark + `'; echo "git broken on purpose" >&2; exit 128; fi
	done
fi
exec '` + real + `' "$@"
`
	if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return bin, mark
}

// An early request whose patch git fails to compute, where the helper
// needs the patch (its native push declines): the command does not run on
// a tree made without it; the exchange asks to prepare again, the full
// scan that follows makes the patch, and the command runs once, on the
// local tree.
func TestEarlyRequestWhosePatchFailsRunsNothingOnAWrongTree(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "count\n"})
	bin, mark := failingGit(t)
	f.s = newTrackedSyncer(t, Options{Git: bin})
	h := watchHows(t, f)
	if _, _, err := f.fused("true"); err != nil {
		t.Fatal(err)
	}
	nativeOff(t, f)
	h.take()
	writeFile(t, filepath.Join(f.local, "a.txt"), "one\n")
	writeFile(t, mark, "")
	again := againExchanges.Load()
	out, fr, err := f.fused("echo ran >> count; cat a.txt")
	if err != nil || !fr.Ran {
		t.Fatalf("ran %v, err %v, output %q", fr.Ran, err, out)
	}
	if _, err := os.Stat(mark); err == nil {
		t.Fatal("no diff ran behind the early request")
	}
	if got := h.take(); len(got) != 2 || got[0] != "early" || !strings.HasPrefix(got[1], "full:") {
		t.Fatalf("prepared %v, want an early request, then a full scan", got)
	}
	if n := againExchanges.Load() - again; n != 1 {
		t.Fatalf("%d exchanges asked to prepare again, want 1", n)
	}
	if out != "one\n" {
		t.Fatalf("the command saw a.txt as %q", out)
	}
	if got := f.inSandbox("cat count; rm count"); got != "ran\n" {
		t.Fatalf("the command ran %q times", got)
	}
	assertTree(t, f.sandbox, syncedTree(t, f.local))
}

// convertingGit is a git whose update-index converts line ends
// (core.autocrlf) while mark exists, which no file the sync reads says: a
// conversion the early request's gate cannot see.
func convertingGit(t *testing.T) (bin, mark string) {
	t.Helper()
	real, err := exec.LookPath("git")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	bin, mark = filepath.Join(dir, "git"), filepath.Join(dir, "convert")
	script := `#!/bin/sh
if [ -e '` + mark + `' ] && [ "$1" = update-index ]; then exec '` + real + `' -c core.autocrlf=true "$@"; fi
exec '` + real + `' "$@"
`
	if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return bin, mark
}

// When git stages a file otherwise than the early request's entries said
// (a conversion nothing the sync reads tells of), the repository's
// requests wait for the patch from then on, and the sandbox gets what git
// stored; a change of its configuration lets them leave early again.
func TestEarlyRequestThatGitDisagreesWithIsTurnedOff(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	bin, mark := convertingGit(t)
	f.s = newTrackedSyncer(t, Options{Git: bin})
	// The disagreement is the point: not an error of the test's verify.
	f.s.verify = false
	h := watchHows(t, f)
	step := func(name, text, wantHow, want string) {
		t.Helper()
		writeFile(t, filepath.Join(f.local, "a.txt"), text)
		if _, fr, err := f.fused("true"); err != nil || !fr.Ran {
			t.Fatalf("%s: ran %v, err %v", name, fr.Ran, err)
		}
		if got := h.take(); len(got) != 1 || !strings.HasPrefix(got[0], wantHow) {
			t.Fatalf("%s: prepared %v, want %s", name, got, wantHow)
		}
		// The check against git ends behind the exec: a write before
		// then is a race with it, not a disagreement.
		f.patchesComputed()
		if want != "" {
			if got := string(fileBytes(t, filepath.Join(f.sandbox, "a.txt"))); got != want {
				t.Fatalf("%s: the sandbox's a.txt is %q, want %q", name, got, want)
			}
		}
	}
	step("first", "a\n", "full:", "a\n")
	writeFile(t, mark, "")
	// The entries said CRLF, git staged LF: noticed once git is done.
	step("disagreement", "one\r\n", "early", "")
	step("after it", "two\r\n", "incremental", "two\n")
	if err := os.Remove(mark); err != nil {
		t.Fatal(err)
	}
	testutil.Git(t, f.local, "config", "sandboxd.test", "changed")
	step("configuration changed", "three\n", "full:config", "three\n")
	step("early again", "four\n", "early", "four\n")
}

// TestEarlyPatchOutlivesTheExecThatSentIt: the patch behind an early
// request is still computed when the exec's context ends as soon as the
// request is made (a quick command whose caller is done): the next sync
// is early again, not a scan of the whole tree.
func TestEarlyPatchOutlivesTheExecThatSentIt(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	h := watchHows(t, f)
	if _, fr, err := f.fused("true"); err != nil || !fr.Ran {
		t.Fatalf("first exec: ran %v, err %v", fr.Ran, err)
	}
	h.take()
	writeFile(t, filepath.Join(f.local, "a.txt"), "one\n")
	ctx, cancel := context.WithCancel(context.Background())
	p, err := f.s.PrepareExchange(ctx, f.r, f.local, f.base)
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	if got := h.take(); len(got) != 1 || got[0] != "early" {
		t.Fatalf("prepared %v, want early", got)
	}
	if err := p.early.wait(context.Background()); err != nil {
		t.Fatalf("the patch behind the request, its exec's context ended: %v", err)
	}
	writeFile(t, filepath.Join(f.local, "a.txt"), "two\n")
	if _, fr, err := f.fused("true"); err != nil || !fr.Ran {
		t.Fatalf("next exec: ran %v, err %v", fr.Ran, err)
	}
	if got := h.take(); len(got) != 1 || got[0] != "early" {
		t.Fatalf("the next exec prepared %v, want early (not a full scan)", got)
	}
}

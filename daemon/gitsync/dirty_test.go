package gitsync

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/internal/testutil"
	"github.com/sandboxd/sandboxd/internal/watch"
)

// Each case changes the working tree (or what git makes of it) in a way
// that a stale change set would get wrong. The fixture's Syncer checks
// every incremental patch against a full scan, and the sandbox must end
// up equal to the local tree.
func TestIncrementalPatchFollowsEveryChange(t *testing.T) {
	cases := []struct {
		name   string
		files  map[string]string
		before func(f *fixture) // before the first (full) Prepare
		change func(f *fixture)
		// noTree: the sandbox does not get the local tree as it is (LFS
		// files, modes under core.fileMode=false), so only the check
		// against a full scan applies.
		noTree bool
		// full: settings under which every Prepare scans.
		full bool
	}{
		{name: "edit, add, delete", change: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "a.txt"), "a edited\n")
			writeFile(f.t, filepath.Join(f.local, "new/deep/n.txt"), "n\n")
			rm(f, "b.txt")
		}},
		{name: "edit back to HEAD", before: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "a.txt"), "a edited\n")
		}, change: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "a.txt"), "a\n")
		}},
		{name: "gitignore un-ignores a file nobody touched", files: map[string]string{".gitignore": "*.log\n"}, before: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "x.log"), "log\n")
		}, change: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, ".gitignore"), "*.tmp\n")
		}},
		{name: "gitignore ignores an untracked file", files: map[string]string{".gitignore": "*.tmp\n"}, before: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "x.log"), "log\n")
		}, change: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, ".gitignore"), "*.log\n")
		}},
		{name: "info/exclude changes", before: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "x.log"), "log\n")
		}, change: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, ".git/info/exclude"), "*.log\n")
		}},
		{name: "an ignored file force-added to the index", files: map[string]string{".gitignore": "*.log\n"}, before: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "x.log"), "log\n")
		}, change: func(f *fixture) {
			testutil.Git(f.t, f.local, "add", "-f", "x.log")
		}},
		{name: "an ignored tracked file removed from the index", files: map[string]string{"keep.log": "kept\n"}, before: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, ".gitignore"), "*.log\n")
		}, change: func(f *fixture) {
			testutil.Git(f.t, f.local, "rm", "-q", "--cached", "keep.log")
		}},
		{name: "an edited ignored tracked file", files: map[string]string{".gitignore": "*.log\n", "keep.log": "kept\n"}, change: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "keep.log"), "edited\n")
		}},
		{name: "an ignored untracked file edited", files: map[string]string{".gitignore": "build/\n"}, change: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "build/out.o"), "obj\n")
		}},
		{name: "commit", before: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "a.txt"), "a edited\n")
		}, change: func(f *fixture) {
			testutil.Git(f.t, f.local, "commit", "-q", "-am", "local")
		}},
		{name: "branch switch", before: func(f *fixture) {
			testutil.Git(f.t, f.local, "checkout", "-q", "-b", "other")
			writeFile(f.t, filepath.Join(f.local, "other.txt"), "other\n")
			testutil.Git(f.t, f.local, "add", "-A")
			testutil.Git(f.t, f.local, "commit", "-q", "-m", "other")
			testutil.Git(f.t, f.local, "checkout", "-q", "main")
			writeFile(f.t, filepath.Join(f.local, "wip.txt"), "wip\n")
		}, change: func(f *fixture) {
			testutil.Git(f.t, f.local, "checkout", "-q", "other")
		}},
		{name: "reset --soft keeps the files, moves HEAD", before: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "a.txt"), "a edited\n")
			testutil.Git(f.t, f.local, "commit", "-q", "-am", "local")
		}, change: func(f *fixture) {
			testutil.Git(f.t, f.local, "reset", "-q", "--soft", "HEAD~")
		}},
		{name: "directory moved out of the tree", files: map[string]string{"d/x.txt": "x\n", "d/sub/y.txt": "y\n"}, before: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "d/sub/y.txt"), "y edited\n")
		}, change: func(f *fixture) {
			mv(f, "d", filepath.Join(f.t.TempDir(), "d"))
		}},
		{name: "directory renamed, then a file in it edited", files: map[string]string{"d/x.txt": "x\n", "d/sub/y.txt": "y\n"}, change: func(f *fixture) {
			mv(f, "d", filepath.Join(f.local, "e"))
			writeFile(f.t, filepath.Join(f.local, "e/sub/y.txt"), "y edited\n")
		}},
		{name: "directory moved away and back", files: map[string]string{"d/x.txt": "x\n"}, change: func(f *fixture) {
			mv(f, "d", filepath.Join(f.local, "e"))
			mv(f, "e", filepath.Join(f.local, "d"))
			writeFile(f.t, filepath.Join(f.local, "d/x.txt"), "x edited\n")
		}},
		{name: "directory replaced by a file", files: map[string]string{"d/x.txt": "x\n"}, change: func(f *fixture) {
			if err := os.RemoveAll(filepath.Join(f.local, "d")); err != nil {
				f.t.Fatal(err)
			}
			writeFile(f.t, filepath.Join(f.local, "d"), "now a file\n")
		}},
		{name: "file replaced by a directory", files: map[string]string{"d": "a file\n"}, change: func(f *fixture) {
			rm(f, "d")
			writeFile(f.t, filepath.Join(f.local, "d/x.txt"), "x\n")
		}},
		{name: "directory created with mkdir -p and filled at once", change: func(f *fixture) {
			for i := 0; i < 30; i++ {
				writeFile(f.t, filepath.Join(f.local, fmt.Sprintf("n/%d/%d/f.txt", i%3, i)), "x\n")
			}
		}},
		{name: "editor saves by rename", change: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, ".a.txt.swp"), "a saved\n")
			mv(f, ".a.txt.swp", filepath.Join(f.local, "a.txt"))
		}},
		{name: "rename detected", files: map[string]string{"big.txt": strings.Repeat("line\n", 50)}, change: func(f *fixture) {
			mv(f, "big.txt", filepath.Join(f.local, "moved.txt"))
		}},
		{name: "mode change", change: func(f *fixture) {
			if err := os.Chmod(filepath.Join(f.local, "a.txt"), 0o755); err != nil {
				f.t.Fatal(err)
			}
		}},
		{name: "mode change with core.fileMode false", noTree: true, full: true, before: func(f *fixture) {
			testutil.Git(f.t, f.local, "config", "core.fileMode", "false")
		}, change: func(f *fixture) {
			if err := os.Chmod(filepath.Join(f.local, "a.txt"), 0o755); err != nil {
				f.t.Fatal(err)
			}
			writeFile(f.t, filepath.Join(f.local, "x.sh"), "new\n")
			if err := os.Chmod(filepath.Join(f.local, "x.sh"), 0o755); err != nil {
				f.t.Fatal(err)
			}
		}},
		{name: "symlink retargeted", before: func(f *fixture) {
			if err := os.Symlink("a.txt", filepath.Join(f.local, "link")); err != nil {
				f.t.Fatal(err)
			}
		}, change: func(f *fixture) {
			rm(f, "link")
			if err := os.Symlink("b.txt", filepath.Join(f.local, "link")); err != nil {
				f.t.Fatal(err)
			}
		}},
		{name: "binary", change: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "bin.dat"), randomBytes(3000, 7))
		}},
		{name: "same content rewritten", change: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "a.txt"), "a\n")
		}},
		{name: "LFS files left out", files: map[string]string{".gitattributes": "*.psd filter=lfs diff=lfs merge=lfs -text\n", "art.psd": "pointer\n"}, noTree: true, change: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "art.psd"), "big local binary\n")
			writeFile(f.t, filepath.Join(f.local, "new.psd"), "another\n")
			writeFile(f.t, filepath.Join(f.local, "a.txt"), "a edited\n")
		}},
		// git add converts these files: the changed paths are staged by
		// git, not in-process (the check against a full scan fails if
		// they are hashed as they are).
		{name: "line ends that attributes convert", files: map[string]string{".gitattributes": "*.txt text\n"}, noTree: true, change: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "a.txt"), "crlf\r\nline\r\n")
			writeFile(f.t, filepath.Join(f.local, "new.txt"), "new\r\n")
		}},
		{name: "line ends that core.autocrlf converts", noTree: true, before: func(f *fixture) {
			testutil.Git(f.t, f.local, "config", "core.autocrlf", "input")
		}, change: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "a.txt"), "crlf\r\nline\r\n")
		}},
		{name: "a clean filter", files: map[string]string{".gitattributes": "*.txt filter=upper\n"}, noTree: true, before: func(f *fixture) {
			testutil.Git(f.t, f.local, "config", "filter.upper.clean", "tr a-z A-Z")
		}, change: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "a.txt"), "lower case\n")
		}},
		{name: "a clean filter in info/attributes", noTree: true, before: func(f *fixture) {
			testutil.Git(f.t, f.local, "config", "filter.upper.clean", "tr a-z A-Z")
			writeFile(f.t, filepath.Join(f.local, ".git/info/attributes"), "*.txt filter=upper\n")
		}, change: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "a.txt"), "lower case\n")
		}},
		{name: "attributes that convert nothing", files: map[string]string{".gitattributes": "*.bin binary\n*.txt diff=plain\n"}, change: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "a.txt"), "edited\r\n")
			writeFile(f.t, filepath.Join(f.local, "x.bin"), "\x00\x01")
		}},
		{name: "stash with untracked files", before: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "a.txt"), "a edited\n")
			writeFile(f.t, filepath.Join(f.local, "u/new.txt"), "u\n")
		}, change: func(f *fixture) {
			testutil.Git(f.t, f.local, "stash", "-q", "-u")
		}},
		{name: "stash pop", before: func(f *fixture) {
			writeFile(f.t, filepath.Join(f.local, "a.txt"), "a edited\n")
			writeFile(f.t, filepath.Join(f.local, "u/new.txt"), "u\n")
			testutil.Git(f.t, f.local, "stash", "-q", "-u")
		}, change: func(f *fixture) {
			testutil.Git(f.t, f.local, "stash", "pop", "-q")
		}},
		{name: "a repository created inside", change: func(f *fixture) {
			testutil.Git(f.t, f.local, "init", "-q", "inner")
			writeFile(f.t, filepath.Join(f.local, "inner/i.txt"), "i\n")
			testutil.Git(f.t, filepath.Join(f.local, "inner"), "add", "-A")
			testutil.Git(f.t, filepath.Join(f.local, "inner"), "commit", "-q", "-m", "inner")
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			files := map[string]string{"a.txt": "a\n", "b.txt": "b\n"}
			for k, v := range c.files {
				files[k] = v
			}
			f := newFixture(t, files)
			var hows []string
			f.s.observe = func(how string) { hows = append(hows, how) }
			if c.before != nil {
				c.before(f)
			}
			f.compareTrees = !c.noTree
			f.syncCompare()
			c.change(f)
			p := f.syncCompare()
			// Nothing changed since: the same patch again, without a scan.
			again, err := f.s.Prepare(context.Background(), f.local, f.base)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(again.Data, p.Data) {
				t.Fatalf("the same tree gave another patch:\n%s\nthen:\n%s", p.Data, again.Data)
			}
			if c.full {
				for _, h := range hows {
					if h == "incremental" {
						t.Fatalf("prepares %v: want only full scans", hows)
					}
				}
			} else if len(hows) != 3 || hows[2] != "incremental" {
				t.Fatalf("prepares: %v, want the third incremental", hows)
			}
			t.Logf("prepares: %v", hows)
		})
	}
}

// syncCompare prepares and pushes (push-only, so no exec's edits are
// pending) and checks the sandbox now holds exactly the local tree.
func (f *fixture) syncCompare() *Patch {
	f.t.Helper()
	ctx := context.Background()
	p, err := f.s.Prepare(ctx, f.local, f.base)
	if err != nil {
		f.t.Fatalf("prepare: %v", err)
	}
	p.Sandbox, p.PushOnly = "fixture", true
	if _, err := f.s.Push(ctx, f.r, p); err != nil {
		f.t.Fatalf("push: %v", err)
	}
	if f.compareTrees {
		assertTree(f.t, f.sandbox, syncedTree(f.t, f.local))
	}
	return p
}

// syncedTree is the tree as the sync sees it: no untracked ignored files,
// nothing inside another repository.
func syncedTree(t *testing.T, root string) map[string]string {
	tr := tree(t, root)
	for _, p := range splitZ([]byte(testutil.Git(t, root, "ls-files", "-z", "--others", "--ignored", "--exclude-standard"))) {
		delete(tr, p)
	}
	for p := range tr {
		if strings.HasPrefix(p, "inner/") {
			delete(tr, p)
		}
	}
	return tr
}

func rm(f *fixture, name string) {
	f.t.Helper()
	if err := os.Remove(filepath.Join(f.local, name)); err != nil {
		f.t.Fatal(err)
	}
}

func mv(f *fixture, name, to string) {
	f.t.Helper()
	if err := os.Rename(filepath.Join(f.local, name), to); err != nil {
		f.t.Fatal(err)
	}
}

// The files a pull writes are changes like any other: the next Prepare
// sends them (the sandbox already has them, so it ends up the same).
func TestPulledFilesAreInTheNextPatch(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	if _, _, err := f.exec("echo from sandbox > a.txt && echo new > n.txt"); err != nil {
		t.Fatal(err)
	}
	p := f.syncCompare()
	if strings.Join(p.Files, ",") != "a.txt,n.txt" {
		t.Fatalf("files %v", p.Files)
	}
	if _, _, err := f.exec("rm n.txt"); err != nil {
		t.Fatal(err)
	}
	if p := f.syncCompare(); strings.Join(p.Files, ",") != "a.txt" {
		t.Fatalf("files %v", p.Files)
	}
}

// The daemon's first Prepare after a start scans everything: what changed
// while it was down is seen.
func TestChangesWhileTheDaemonWasDown(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	f.syncCompare()
	writeFile(t, filepath.Join(f.local, "a.txt"), "changed while down\n")
	f.s = newTrackedSyncer(t, Options{}) // a new daemon: a new tracker
	if p := f.syncCompare(); strings.Join(p.Files, ",") != "a.txt" {
		t.Fatalf("files %v", p.Files)
	}
}

// When the tracker loses events (too many changes at once) the next
// Prepare scans everything.
func TestTrackerOverflowScansEverything(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	trees := watch.NewTrees(watch.TreesOptions{MaxDirty: 5})
	t.Cleanup(func() { _ = trees.Close() })
	f.s = New(Options{Changes: trees})
	f.s.verify = true
	var hows []string
	f.s.observe = func(how string) { hows = append(hows, how) }
	f.syncCompare()
	for i := 0; i < 20; i++ {
		writeFile(t, filepath.Join(f.local, fmt.Sprintf("f%02d.txt", i)), "x\n")
	}
	if p := f.syncCompare(); len(p.Files) != 20 {
		t.Fatalf("files %v", p.Files)
	}
	if hows[1] != "full:tracker" {
		t.Fatalf("prepares %v: want a full scan after the overflow", hows)
	}
}

// Prepare with nothing changed starts no process; one changed file costs
// a fixed number of git processes, whatever the size of the tree.
func TestPrepareProcessCount(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n", "b.txt": "b\n"})
	for i := 0; i < 300; i++ {
		writeFile(t, filepath.Join(f.local, fmt.Sprintf("d%d/f%d.txt", i%10, i)), "x\n")
	}
	testutil.Git(t, f.local, "add", "-A")
	testutil.Git(t, f.local, "commit", "-q", "-m", "more")
	f.base = strings.TrimSpace(testutil.Git(t, f.local, "rev-parse", "HEAD"))
	counter := filepath.Join(t.TempDir(), "count")
	wrapper := filepath.Join(t.TempDir(), "git")
	writeFile(t, wrapper, fmt.Sprintf("#!/bin/sh\necho \"$1\" >> %s\nexec git \"$@\"\n", counter))
	if err := os.Chmod(wrapper, 0o755); err != nil {
		t.Fatal(err)
	}
	f.s = newTrackedSyncer(t, Options{Git: wrapper})
	f.s.verify = false // it runs git too
	ctx := context.Background()
	calls := func() []string {
		b, _ := os.ReadFile(counter)
		_ = os.Remove(counter)
		return strings.Fields(string(b))
	}
	writeFile(t, filepath.Join(f.local, "a.txt"), "edited\n")
	if _, err := f.s.Prepare(ctx, f.local, f.base); err != nil {
		t.Fatal(err)
	}
	t.Logf("first (full) prepare: %v", calls())
	// expect prepares and checks which git commands ran and the files.
	expect := func(what, gitRan, files string) {
		t.Helper()
		p, err := f.s.Prepare(ctx, f.local, f.base)
		if err != nil {
			t.Fatal(err)
		}
		if c := strings.Join(calls(), ","); c != gitRan || strings.Join(p.Files, ",") != files {
			t.Fatalf("%s: git ran %q, files %v; want %q, %s", what, c, p.Files, gitRan, files)
		}
	}
	for i := 0; i < 3; i++ {
		expect("nothing changed", "", "a.txt")
	}
	writeFile(t, filepath.Join(f.local, "d3/f3.txt"), "edited\n")
	// Staged into the sync index of the changed paths, then diffed: two
	// processes, whatever the tree holds.
	expect("one tracked file edited", "update-index,diff", "a.txt,d3/f3.txt")
	writeFile(t, filepath.Join(f.local, "new.txt"), "new\n")
	expect("one new file", "check-ignore,update-index,diff", "a.txt,d3/f3.txt,new.txt")
	// The same new file edited again: git was asked already whether it
	// ignores it.
	writeFile(t, filepath.Join(f.local, "new.txt"), "new, edited\n")
	expect("the new file edited again", "update-index,diff", "a.txt,d3/f3.txt,new.txt")
}

// Prepares of one repository from many sandboxes at once agree.
func TestConcurrentPreparesAgree(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	f.syncCompare()
	writeFile(t, filepath.Join(f.local, "a.txt"), "edited\n")
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p, err := f.s.Prepare(context.Background(), f.local, f.base)
			if err == nil && strings.Join(p.Files, ",") != "a.txt" {
				err = fmt.Errorf("files %v", p.Files)
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
}

// A file rewritten with the same size in the second the index was last
// written ("racy git") is seen by a full scan: the copy of the index keeps
// the index's time, so git checks that entry's content instead of trusting
// its stat data.
func TestFullScanSeesRacilyCleanFile(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "aaaa\n"})
	f.s = New(Options{}) // the full scan alone
	a, index := filepath.Join(f.local, "a.txt"), filepath.Join(f.local, ".git", "index")
	past := time.Now().Add(-time.Minute).Truncate(time.Second)
	for try := 0; ; try++ {
		if err := os.Chtimes(a, past, past); err != nil {
			t.Fatal(err)
		}
		testutil.Git(t, f.local, "update-index", "--refresh")
		sec := time.Now().Unix()
		// Same size, same mtime, same inode, ctime most likely in the same
		// second: only the content tells.
		fh, err := os.OpenFile(a, os.O_WRONLY|os.O_TRUNC, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := fh.WriteString("bbbb\n"); err != nil {
			t.Fatal(err)
		}
		_ = fh.Close()
		if err := os.Chtimes(a, past, past); err != nil {
			t.Fatal(err)
		}
		if time.Now().Unix() == sec {
			break
		}
		if try == 5 {
			t.Skip("could not rewrite the file within one second")
		}
		writeFile(t, a, "aaaa\n")
	}
	// The index dated as the file: its entry is racily clean.
	if err := os.Chtimes(index, past, past); err != nil {
		t.Fatal(err)
	}
	// (git status would see it, and smudge the entry in the index: not
	// run here.)
	p, err := f.s.Prepare(context.Background(), f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(p.Files, ",") != "a.txt" {
		t.Fatalf("files %v: the rewritten file was missed", p.Files)
	}
}

// What git said of an untracked file is kept only while the ignore rules
// stay: a .gitignore that comes to ignore it makes the next edit of the
// file stay out of the patch.
func TestIgnoreAnswersForgottenWhenTheRulesChange(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "*.tmp\n"})
	ctx := context.Background()
	files := func() string {
		t.Helper()
		p, err := f.s.Prepare(ctx, f.local, f.base)
		if err != nil {
			t.Fatal(err)
		}
		return strings.Join(p.Files, ",")
	}
	files() // the first, full scan
	writeFile(t, filepath.Join(f.local, "x.log"), "1\n")
	if got := files(); got != "x.log" {
		t.Fatalf("a new file: %q", got)
	}
	writeFile(t, filepath.Join(f.local, ".gitignore"), "*.log\n")
	if got := files(); got != ".gitignore" {
		t.Fatalf("the new rule: %q", got)
	}
	writeFile(t, filepath.Join(f.local, "x.log"), "2\n")
	if got := files(); got != ".gitignore" {
		t.Fatalf("the ignored file edited: %q, want it left out", got)
	}
}

// The incremental Prepare names the same changes as a full scan, through
// random edits, additions, removals, mode and type changes, files that
// become directories and back, and contents back to HEAD's. The Syncer
// checks each result against a full scan (verify); then the patch is
// pushed, and the sandbox must equal the local tree.
func TestIncrementalPrepareAgreesWithAFullScan(t *testing.T) {
	files := map[string]string{"a.txt": "a\n", "b.txt": "b\n", "d/x.txt": "x\n", "d/y.txt": "y\n", "e/f/g.txt": "g\n"}
	f := newFixture(t, files)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(1, 2))
	paths := []string{"a.txt", "b.txt", "d/x.txt", "d/y.txt", "e/f/g.txt", "n.txt", "d/n.txt", "a.txt", "b.txt", "e", "d"}
	contents := []string{"a\n", "b\n", "x\n", "one\n", "two\n"}
	// clear makes room for abs: nothing there, its parents directories.
	clear := func(abs string) {
		_ = os.RemoveAll(abs)
		for d := filepath.Dir(abs); d != f.local; d = filepath.Dir(d) {
			if fi, err := os.Lstat(d); err == nil && !fi.IsDir() {
				_ = os.Remove(d)
			}
		}
		if err := os.MkdirAll(filepath.Dir(abs), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for step := 0; step < 200; step++ {
		for n := 1 + rng.IntN(2); n > 0; n-- {
			p := paths[rng.IntN(len(paths))]
			abs := filepath.Join(f.local, p)
			switch op := rng.IntN(20); {
			case op < 9:
				clear(abs)
				writeFile(t, abs, contents[rng.IntN(len(contents))])
			case op < 12:
				_ = os.RemoveAll(abs)
			case op < 17:
				if fi, err := os.Lstat(abs); err == nil && fi.Mode().IsRegular() {
					mode := os.FileMode(0o755)
					if fi.Mode()&0o100 != 0 {
						mode = 0o644
					}
					_ = os.Chmod(abs, mode)
				}
			case op < 19:
				clear(abs)
				_ = os.Symlink(contents[rng.IntN(len(contents))][:1], abs)
			default:
				// A directory where there may have been a file.
				clear(abs)
				writeFile(t, filepath.Join(abs, "in.txt"), "in\n")
			}
		}
		if _, err := f.s.Prepare(ctx, f.local, f.base); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		f.syncCompare()
	}
}

// The incremental Prepare reads which paths the user's index tracks
// (version 2 and 4 indexes), so a tracked file that .gitignore matches is
// synced and one the user stops tracking is not; an index it does not
// read (split) or one with skip-worktree entries, whose files git add -A
// leaves alone, makes every Prepare a full scan. The Syncer checks each
// result against a full scan (verify).
func TestIncrementalPrepareReadsEveryIndexLayout(t *testing.T) {
	for name, layout := range map[string][]string{
		"version 2":     {"update-index", "--index-version", "2"},
		"version 4":     {"update-index", "--index-version", "4"},
		"split":         {"update-index", "--split-index"},
		"skip-worktree": {"update-index", "--skip-worktree", "b.txt"},
	} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t, map[string]string{"a.txt": "a\n", "b.txt": "b\n", "kept.log": "k\n"})
			testutil.Git(t, f.local, layout...)
			sparse := name == "skip-worktree"
			full := sparse || name == "split"
			// The sandbox gets b.txt's committed content, not the local one.
			f.compareTrees = !sparse
			var hows []string
			f.s.observe = func(how string) { hows = append(hows, how) }
			step := func(what string, change func(), files string) {
				t.Helper()
				hows = nil
				change()
				if p := f.syncCompare(); strings.Join(p.Files, ",") != files {
					t.Fatalf("%s: files %v, want %s", what, p.Files, files)
				}
				if incremental := hows[0] == "incremental"; incremental == full {
					t.Fatalf("%s: the prepare was %q", what, hows[0])
				}
			}
			f.syncCompare() // the first, full scan
			wantB := "a.txt,b.txt"
			if sparse {
				wantB = "a.txt"
			}
			step("two tracked files edited", func() {
				writeFile(t, filepath.Join(f.local, "a.txt"), "a2\n")
				writeFile(t, filepath.Join(f.local, "b.txt"), "b2\n")
			}, wantB)
			writeFile(t, filepath.Join(f.local, ".gitignore"), "*.log\n")
			f.syncCompare() // a new rule: a full scan
			step("a tracked file the rules ignore, edited", func() {
				writeFile(t, filepath.Join(f.local, "kept.log"), "k2\n")
			}, ".gitignore,"+wantB+",kept.log")
			step("that file no longer tracked", func() {
				testutil.Git(t, f.local, "rm", "-q", "--cached", "kept.log")
			}, ".gitignore,"+wantB+",kept.log")
		})
	}
}

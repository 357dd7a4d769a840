package gitsync

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/internal/gitobj"
	"github.com/sandboxd/sandboxd/internal/testutil"
)

// The in-process staging leaves the index git update-index would: the same
// entries (mode, blob, path) and a file git reads, replacements of a file
// by a directory and back included.
func TestMemIndexAgreesWithUpdateIndex(t *testing.T) {
	isolate(t)
	dir := t.TempDir()
	testutil.Git(t, dir, "init", "-q")
	writeFile(t, filepath.Join(dir, "seed"), "seed\n")
	testutil.Git(t, dir, "add", "seed")
	testutil.Git(t, dir, "commit", "-q", "-m", "seed")

	// What both indexes start from: entries that the working tree below
	// replaces (d/x by a file d, e by a directory e).
	seed := strings.TrimSpace(testutil.Git(t, dir, "hash-object", "-w", "seed"))
	initial := "100644 " + seed + "\td/x\x00100644 " + seed + "\te\x00100644 " + seed + "\tgone.txt\x00100644 " + seed + "\tkept.txt\x00"
	oid, _ := gitobj.ParseOID(seed)
	m := memIndex{"d/x": {mode: gitobj.ModeFile, oid: oid}, "e": {mode: gitobj.ModeFile, oid: oid},
		"gone.txt": {mode: gitobj.ModeFile, oid: oid}, "kept.txt": {mode: gitobj.ModeFile, oid: oid}}

	writeFile(t, filepath.Join(dir, "d"), "d is a file now\n")
	writeFile(t, filepath.Join(dir, "e/y"), "e is a directory now\n")
	writeFile(t, filepath.Join(dir, "plain.txt"), "plain\n")
	writeFile(t, filepath.Join(dir, "with space é.txt"), "unicode\n")
	writeFile(t, filepath.Join(dir, "tool.sh"), "#!/bin/sh\n")
	if err := os.Chmod(filepath.Join(dir, "tool.sh"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("plain.txt", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "empty"), "")
	writeFile(t, filepath.Join(dir, "forced.txt"), "removed by force\n")
	// forced.txt is fed and then force-removed, in git's order.
	feed := []string{"d", "e/y", "plain.txt", "with space é.txt", "tool.sh", "link", "empty", "gone.txt", "forced.txt"}
	remove := []string{"forced.txt"}

	byGit := filepath.Join(t.TempDir(), "git-index")
	run := func(stdin string, args ...string) string {
		t.Helper()
		cmd := exec.Command("git", args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GIT_INDEX_FILE="+byGit)
		cmd.Stdin = strings.NewReader(stdin)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	run(initial, "update-index", "-z", "--index-info")
	run(strings.Join(feed, "\x00")+"\x00", "update-index", "-z", "--add", "--remove", "--replace", "--stdin")
	run(strings.Join(remove, "\x00")+"\x00", "update-index", "-z", "--force-remove", "--stdin")

	objects, err := gitobj.OpenStore(filepath.Join(dir, ".git"))
	if err != nil {
		t.Fatal(err)
	}
	blobs, err := m.stage(dir, feed, remove)
	if err == nil {
		err = writeBlobs(objects, blobs)
	}
	if err != nil {
		t.Fatal(err)
	}
	byUs := filepath.Join(t.TempDir(), "our-index")
	if err := m.write(byUs); err != nil {
		t.Fatal(err)
	}
	list := func(index string) string {
		t.Helper()
		cmd := exec.Command("git", "ls-files", "-s")
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GIT_INDEX_FILE="+index)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("git ls-files with %s: %v\n%s", index, err, out)
		}
		return string(out)
	}
	want, got := list(byGit), list(byUs)
	if got != want {
		t.Fatalf("the index staged in-process:\n%s\ngit update-index's:\n%s", got, want)
	}
	// git reads the blobs it names, and checks the file's checksum.
	cmd := exec.Command("git", "diff", "--cached", "--stat", "HEAD")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GIT_INDEX_FILE="+byUs)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("git diff --cached with the index staged in-process: %v\n%s", err, out)
	}
	t.Logf("entries:\n%s", got)
}

// A path in-process staging does not vouch for goes to git, and leaves the
// index in memory as it was.
func TestMemIndexLeavesToGit(t *testing.T) {
	dir := t.TempDir()
	big := filepath.Join(dir, "big")
	if err := os.WriteFile(big, make([]byte, maxInProcessFile+1), 0o644); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "ok.txt"), "ok\n")
	for _, feed := range [][]string{{"ok.txt", "big"}, {"ok.txt", "a/../x"}, {".git/config"}} {
		m := memIndex{}
		if _, err := m.stage(dir, feed, nil); err != errToGit {
			t.Fatalf("stage %q: %v, want errToGit", feed, err)
		}
		if len(m) != 0 {
			t.Fatalf("stage %q changed the index: %v", feed, m)
		}
	}
}

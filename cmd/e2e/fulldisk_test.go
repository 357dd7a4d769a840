package e2e

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

// smallDisk mounts a tmpfs of size at dir (the tests run as root).
func smallDisk(t *testing.T, dir, size string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size="+size, "tmpfs", dir).CombinedOutput(); err != nil {
		testutil.Unavailable(t, fmt.Sprintf("a small tmpfs cannot be mounted (%v %s)", err, out), "run the test as root, as CI does")
	}
	t.Cleanup(func() { _ = exec.Command("umount", "-l", dir).Run() })
}

// fillDisk fills the filesystem of file, leaving about room bytes free.
func fillDisk(t *testing.T, file string, room int64) {
	t.Helper()
	f, err := os.Create(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	chunk := make([]byte, 64<<10)
	var n int64
	for {
		w, err := f.Write(chunk)
		n += int64(w)
		if errors.Is(err, syscall.ENOSPC) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Truncate(max(n-room, 0)); err != nil {
		t.Fatal(err)
	}
}

// TestFullDiskDuringPullLeavesTheTreeIntact: the sandbox's edits arrive on
// a full disk: the working tree is as it was (no truncated file, no half
// of the patch), the message says the disk is full, where the edits are
// and what to free, never "safe to retry" nor that the daemon stopped, and
// no empty patch file is left; once space is freed the next exec brings
// the edits back.
func TestFullDiskDuringPullLeavesTheTreeIntact(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	smallDisk(t, filepath.Join(e.root, "src", "full"), "8m")
	repo := e.newRepo("full", defaultConfig)
	writeFile(t, filepath.Join(repo, "big.txt"), "original\n")
	writeFile(t, filepath.Join(repo, "small.txt"), "small original\n")
	e.git(repo, "add", "-A")
	e.git(repo, "commit", "-q", "-m", "files")
	e.mustNook(repo, "exec", "--", "true")

	filler := filepath.Join(repo, ".git", "filler")
	fillDisk(t, filler, 32<<10)
	r := e.nook(repo, "exec", "--", "sh", "-c", "head -c 700000 /dev/urandom | od -x > big.txt; echo small changed > small.txt")
	if got := readFile(t, filepath.Join(repo, "big.txt")); got != "original\n" {
		t.Fatalf("the working tree changed on a full disk: big.txt has %d bytes: %s", len(got), r)
	}
	if got := readFile(t, filepath.Join(repo, "small.txt")); got != "small original\n" {
		t.Fatalf("half of the patch was applied on a full disk: small.txt is %q: %s", got, r)
	}
	for _, want := range []string{"no space left", "working tree is as it was", "free at least", "next exec"} {
		if !strings.Contains(r.stderr, want) {
			t.Fatalf("the full disk's message lacks %q: %s", want, r)
		}
	}
	checkNoLeftovers(t, repo)

	// Still full: the next exec says so before the command, and does not
	// call it safe to retry.
	r = e.nook(repo, "exec", "--", "true")
	if r.code == 0 || !strings.Contains(r.stderr, "no space left") || strings.Contains(r.stderr, "safe to retry") || strings.Contains(r.stderr, "never pulled (the daemon stopped") {
		t.Fatalf("an exec on a still full disk must say so, and not that it is safe to retry: %s", r)
	}
	if got := readFile(t, filepath.Join(repo, "big.txt")); got != "original\n" {
		t.Fatalf("the working tree changed on a full disk: big.txt has %d bytes: %s", len(got), r)
	}
	checkNoLeftovers(t, repo)

	// Space freed: the edits come back.
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	e.mustNook(repo, "exec", "--", "true")
	if got := readFile(t, filepath.Join(repo, "small.txt")); got != "small changed\n" {
		t.Fatalf("the sandbox's edits did not come back once space was freed: small.txt is %q", got)
	}
	if got := readFile(t, filepath.Join(repo, "big.txt")); len(got) < 700000 {
		t.Fatalf("big.txt did not come back whole: %d bytes", len(got))
	}
}

// checkNoLeftovers fails on empty patch files and on temporary files of a
// pull left in the checkout.
func checkNoLeftovers(t *testing.T, repo string) {
	t.Helper()
	pulls, _ := filepath.Glob(filepath.Join(repo, ".git", "sandboxd", "pulls", "*"))
	for _, p := range pulls {
		if fi, err := os.Stat(p); err == nil && fi.Size() == 0 {
			t.Fatalf("an empty patch file was left: %s", p)
		}
		if strings.HasSuffix(p, ".tmp") {
			t.Fatalf("a partial patch file was left: %s", p)
		}
	}
	entries, _ := os.ReadDir(repo)
	for _, en := range entries {
		if strings.Contains(en.Name(), ".sandboxd-") {
			t.Fatalf("a pull's temporary file was left in the checkout: %s", en.Name())
		}
	}
}

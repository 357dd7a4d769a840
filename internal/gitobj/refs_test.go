package gitobj

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// ReadRef agrees with git rev-parse in the layouts it reads, and sends
// the others to git.
func TestReadRefAgreesWithGit(t *testing.T) {
	r := newTestRepo(t)
	r.git(nil, "", "commit", "-q", "--allow-empty", "-m", "one")
	r.git(nil, "", "update-ref", "refs/sandboxd/base", "HEAD")
	revParse := func(ref string) string { return strings.TrimSpace(string(r.git(nil, "", "rev-parse", ref))) }
	check := func(what, ref string) {
		t.Helper()
		got, ok := ReadRef(r.gitDir, ref)
		if want := revParse(ref); !ok || got != want {
			t.Fatalf("%s: ReadRef(%s) = %q %v, git says %s", what, ref, got, ok, want)
		}
	}
	check("loose", "HEAD")
	check("loose", "refs/sandboxd/base")
	r.git(nil, "", "pack-refs", "--all")
	check("packed", "HEAD")
	check("packed", "refs/sandboxd/base")
	r.git(nil, "", "checkout", "-q", "--detach")
	check("detached", "HEAD")
	for what, ref := range map[string]string{"missing": "refs/sandboxd/none", "not a ref": "../config", "outside refs": "ORIG_HEAD"} {
		if got, ok := ReadRef(r.gitDir, ref); ok {
			t.Fatalf("%s: ReadRef(%s) = %q", what, ref, got)
		}
	}
	// A linked worktree's HEAD names refs that live elsewhere.
	wt := filepath.Join(t.TempDir(), "wt")
	r.git(nil, "", "worktree", "add", "-q", "-b", "other", wt)
	b, err := os.ReadFile(filepath.Join(wt, ".git"))
	if err != nil {
		t.Fatal(err)
	}
	wtGitDir := strings.TrimSpace(strings.TrimPrefix(string(b), "gitdir:"))
	// Even a ref file in the worktree's own directory is not what git reads.
	stale := filepath.Join(wtGitDir, "refs", "heads", "other")
	if err := os.MkdirAll(filepath.Dir(stale), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(stale, []byte(strings.Repeat("0", 40)+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got, ok := ReadRef(wtGitDir, "HEAD"); ok {
		t.Fatalf("worktree HEAD read as %q", got)
	}
}

package watch

import (
	"errors"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/internal/testutil"
)

func newRepo(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	testutil.Git(t, dir, "init", "-q", "-b", "main")
	testutil.Git(t, dir, "commit", "-q", "--allow-empty", "-m", "init")
	return dir
}

type branchChange struct{ root, old, new string }

func newBranches(t *testing.T, opts Options) (*Branches, chan branchChange) {
	t.Helper()
	w, _ := newWatcher(t, opts)
	changes := make(chan branchChange, 16)
	b := NewBranches(w, func(root, old, new string) { changes <- branchChange{root, old, new} })
	return b, changes
}

func expectChange(t *testing.T, changes chan branchChange, want branchChange) {
	t.Helper()
	select {
	case got := <-changes:
		if got != want {
			t.Fatalf("branch change %+v, want %+v", got, want)
		}
	case <-time.After(waitLimit):
		t.Fatalf("timed out waiting for branch change %+v", want)
	}
}

func expectBranch(t *testing.T, b *Branches, root, want string) {
	t.Helper()
	got, err := b.Branch(root)
	if err != nil || got != want {
		t.Fatalf("Branch(%s) = %q, %v; want %q", root, got, err, want)
	}
}

func TestPackageRunsNoGit(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), name, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range f.Imports {
			if p, _ := strconv.Unquote(imp.Path.Value); p == "os/exec" {
				t.Fatalf("%s imports os/exec: the branch cache must not run git", name)
			}
		}
	}
}

func TestBranchCachedAndRefreshedOnCheckout(t *testing.T) {
	for _, tc := range []struct {
		name       string
		maxWatches int
	}{{"inotify", 0}, {"polling", -1}} {
		t.Run(tc.name, func(t *testing.T) {
			repo := newRepo(t)
			b, changes := newBranches(t, Options{MaxWatches: tc.maxWatches})
			// A subdirectory spelling is not a repo root; the root is.
			for range 100 {
				expectBranch(t, b, repo, "main")
			}
			if b.Reads() != 1 {
				t.Fatalf("HEAD read %d times for 100 calls, want 1 (cached)", b.Reads())
			}

			testutil.Git(t, repo, "checkout", "-q", "-b", "other")
			expectChange(t, changes, branchChange{repo, "main", "other"})
			expectBranch(t, b, repo, "other")
			reads := b.Reads()
			for range 100 {
				expectBranch(t, b, repo, "other")
			}
			if b.Reads() != reads {
				t.Fatalf("HEAD re-read on cached calls: %d -> %d", reads, b.Reads())
			}

			// Detached HEAD is named like the RWX CLI names it.
			testutil.Git(t, repo, "checkout", "-q", "--detach")
			want := DetachedPrefix + testutil.Git(t, repo, "rev-parse", "--short", "HEAD")
			expectChange(t, changes, branchChange{repo, "other", want})
			expectBranch(t, b, repo, want)

			// A commit on a branch rewrites the ref, not HEAD: no change.
			testutil.Git(t, repo, "checkout", "-q", "main")
			expectChange(t, changes, branchChange{repo, want, "main"})
			testutil.Git(t, repo, "commit", "-q", "--allow-empty", "-m", "second")
			select {
			case c := <-changes:
				t.Fatalf("unexpected branch change %+v after a commit", c)
			case <-time.After(quiet):
			}
		})
	}
}

func TestDetachedHeadOnFirstRead(t *testing.T) {
	repo := newRepo(t)
	testutil.Git(t, repo, "checkout", "-q", "--detach")
	b, _ := newBranches(t, Options{})
	expectBranch(t, b, repo, DetachedPrefix+testutil.Git(t, repo, "rev-parse", "--short", "HEAD"))
}

func TestWorktree(t *testing.T) {
	repo := newRepo(t)
	wt := filepath.Join(t.TempDir(), "wt")
	testutil.Git(t, repo, "worktree", "add", "-q", "-b", "feature", wt)
	b, changes := newBranches(t, Options{})
	expectBranch(t, b, wt, "feature")
	expectBranch(t, b, repo, "main")

	testutil.Git(t, wt, "checkout", "-q", "-b", "feature2")
	expectChange(t, changes, branchChange{wt, "feature", "feature2"})
	expectBranch(t, b, wt, "feature2")
	expectBranch(t, b, repo, "main")

	// A relative gitdir (as submodules write) resolves against the root.
	rel, err := filepath.Rel(wt, filepath.Join(repo, ".git", "worktrees", "wt"))
	if err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(wt, ".git"), "gitdir: "+rel+"\n")
	b2 := NewBranches(b.w, nil)
	expectBranch(t, b2, wt, "feature2")
}

func TestForgetStopsWatching(t *testing.T) {
	repo := newRepo(t)
	b, changes := newBranches(t, Options{})
	expectBranch(t, b, repo, "main")
	if files, _ := b.w.Watching(); files != 1 {
		t.Fatalf("watching %d files, want HEAD only", files)
	}
	b.Forget(repo)
	b.Forget(repo) // idempotent
	if files, _ := b.w.Watching(); files != 0 {
		t.Fatalf("watching %d files after Forget, want 0", files)
	}
	testutil.Git(t, repo, "checkout", "-q", "-b", "other")
	select {
	case c := <-changes:
		t.Fatalf("change %+v reported after Forget", c)
	case <-time.After(quiet):
	}
	// The next call reads again, and sees the truth.
	reads := b.Reads()
	expectBranch(t, b, repo, "other")
	if b.Reads() != reads+1 {
		t.Fatalf("Reads %d -> %d, want one fresh read after Forget", reads, b.Reads())
	}
}

func TestConcurrentFirstCallsReadOnce(t *testing.T) {
	repo := newRepo(t)
	b, _ := newBranches(t, Options{})
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			if got, err := b.Branch(repo); err != nil || got != "main" {
				t.Errorf("Branch = %q, %v", got, err)
			}
		})
	}
	wg.Wait()
	if b.Reads() != 1 {
		t.Fatalf("HEAD read %d times by concurrent first calls, want 1", b.Reads())
	}
}

func TestBranchBadRepositories(t *testing.T) {
	b, _ := newBranches(t, Options{})
	notRepo := t.TempDir()
	if _, err := b.Branch(notRepo); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("not a repository: %v, want invalid", err)
	}

	badFile := t.TempDir()
	write(t, filepath.Join(badFile, ".git"), "nonsense\n")
	if _, err := b.Branch(badFile); err == nil || !strings.Contains(err.Error(), "gitdir") {
		t.Fatalf(".git file without gitdir: %v", err)
	}

	missing := t.TempDir()
	write(t, filepath.Join(missing, ".git"), "gitdir: /nonexistent/worktree\n")
	if _, err := b.Branch(missing); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("gitdir pointing nowhere: %v, want invalid", err)
	}

	// Corrupting HEAD of a cached repository: never a stale answer.
	repo := newRepo(t)
	expectBranch(t, b, repo, "main")
	head := filepath.Join(repo, ".git", "HEAD")
	write(t, head, "garbage\n")
	deadline := time.Now().Add(waitLimit)
	for {
		_, err := b.Branch(repo)
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "neither a branch ref nor a commit id") {
				t.Fatalf("corrupt HEAD: %v", err)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("corrupt HEAD never reported")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// Repaired: answered again, and watched again.
	write(t, head, "ref: refs/heads/main\n")
	expectBranch(t, b, repo, "main")
	if files, _ := b.w.Watching(); files != 1 {
		t.Fatalf("watching %d files, want the repaired HEAD only", files)
	}
}

func TestParseHead(t *testing.T) {
	sha1 := "0123456789abcdef0123456789abcdef01234567"
	sha256 := sha1 + "0123456789abcdef0123456789abcdef"[:24]
	for _, tc := range []struct {
		in, want, err string
	}{
		{in: "ref: refs/heads/main\n", want: "main"},
		{in: "ref: refs/heads/feat/x-y\n", want: "feat/x-y"},
		{in: "ref:refs/heads/nospace", want: "nospace"},
		{in: sha1 + "\n", want: "detached@0123456"},
		{in: sha256 + "\n", want: "detached@0123456"},
		{in: "ref: refs/tags/v1\n", err: "not a branch"},
		{in: "ref: refs/heads/.invalid\n", err: "reftable"},
		{in: "ref: refs/heads/\n", err: "not a branch"},
		{in: "", err: "neither"},
		{in: strings.ToUpper(sha1), err: "neither"},
		{in: sha1[:39], err: "neither"},
	} {
		got, err := parseHead([]byte(tc.in))
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("parseHead(%q) = %q, %v; want error containing %q", tc.in, got, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("parseHead(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
}

// BenchmarkBranchCached measures the exec hot path's branch lookup.
func BenchmarkBranchCached(b *testing.B) {
	repo := b.TempDir()
	if err := os.MkdirAll(filepath.Join(repo, ".git"), 0o755); err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(repo, ".git", "HEAD"), []byte("ref: refs/heads/main\n"), 0o644); err != nil {
		b.Fatal(err)
	}
	w, err := New(Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Close()
	br := NewBranches(w, nil)
	for b.Loop() {
		if _, err := br.Branch(repo); err != nil {
			b.Fatal(err)
		}
	}
	if br.Reads() != 1 {
		b.Fatalf("HEAD read %d times", br.Reads())
	}
}

// TestBranchIsFreshRightAfterCheckout: a caller that switches branches and
// asks at once gets the new branch, before the watcher's notice arrives
// (polling every hour here, so only the freshness check can see it).
func TestBranchIsFreshRightAfterCheckout(t *testing.T) {
	root := newRepo(t)
	b, _ := newBranches(t, Options{MaxWatches: -1, PollInterval: time.Hour})
	if got, err := b.Branch(root); err != nil || got != "main" {
		t.Fatalf("Branch = %q, %v", got, err)
	}
	testutil.Git(t, root, "checkout", "-q", "-b", "other")
	if got, err := b.Branch(root); err != nil || got != "other" {
		t.Fatalf("right after checkout: Branch = %q, %v; want other", got, err)
	}
	reads := b.Reads()
	if got, _ := b.Branch(root); got != "other" || b.Reads() != reads {
		t.Fatalf("an unchanged HEAD must be answered from the cache (reads %d → %d)", reads, b.Reads())
	}
}

//go:build linux

package watch

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func newTestTree(t *testing.T, o TreesOptions) (*Trees, string, string) {
	t.Helper()
	root := filepath.Join(t.TempDir(), "repo")
	cookies := filepath.Join(root, ".git", "sandboxd", "watch")
	for _, d := range []string{"a/b", ".git/objects"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	tr := NewTrees(o)
	t.Cleanup(func() { _ = tr.Close() })
	return tr, root, cookies
}

func put(t *testing.T, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// The first answer is full; then every change made before a call is in
// its answer (no waiting: the barrier orders it), .git is left out, and a
// directory that appears comes with what is in it.
func TestTreesReportChanges(t *testing.T) {
	tr, root, cookies := newTestTree(t, TreesOptions{})
	ctx := context.Background()
	if _, _, full := tr.Changes(ctx, root, cookies); !full {
		t.Fatal("first answer not full")
	}
	if p, g, full := tr.Changes(ctx, root, cookies); full || len(p) != 0 || len(g) != 0 {
		t.Fatalf("nothing changed: %v %v %v", p, g, full)
	}
	put(t, filepath.Join(root, "a/b/f.txt"), "x")
	put(t, filepath.Join(root, ".git/objects/x"), "x")
	if err := os.MkdirAll(filepath.Join(root, "n/m/o"), 0o755); err != nil {
		t.Fatal(err)
	}
	put(t, filepath.Join(root, "n/m/o/deep.txt"), "x")
	p, g, full := tr.Changes(ctx, root, cookies)
	if full || strings.Join(p, ",") != "a/b/f.txt,n,n/m,n/m/o,n/m/o/deep.txt" || len(g) != 0 {
		t.Fatalf("got %v %v %v", p, g, full)
	}
	// Moved inside the tree: the old subtree is gone, the new one comes
	// whole, and later edits under the new name are seen.
	if err := os.Rename(filepath.Join(root, "n"), filepath.Join(root, "a/n2")); err != nil {
		t.Fatal(err)
	}
	put(t, filepath.Join(root, "a/n2/m/o/deep.txt"), "y")
	p, g, full = tr.Changes(ctx, root, cookies)
	if full || strings.Join(g, ",") != "n" || !strings.Contains(strings.Join(p, ","), "a/n2/m/o/deep.txt") {
		t.Fatalf("got %v %v %v", p, g, full)
	}
	put(t, filepath.Join(root, "a/n2/m/o/deep.txt"), "z")
	p, _, full = tr.Changes(ctx, root, cookies)
	if full || strings.Join(p, ",") != "a/n2/m/o/deep.txt" {
		t.Fatalf("an edit after the move: %v %v", p, full)
	}
	if err := os.Chmod(filepath.Join(root, "a/n2/m/o/deep.txt"), 0o755); err != nil {
		t.Fatal(err)
	}
	if p, _, full = tr.Changes(ctx, root, cookies); full || strings.Join(p, ",") != "a/n2/m/o/deep.txt" {
		t.Fatalf("a mode change: %v %v", p, full)
	}
}

// Too many changes, a new repository inside, and Close: the answer is
// full, never a partial set.
func TestTreesFullWhenUnsure(t *testing.T) {
	tr, root, cookies := newTestTree(t, TreesOptions{MaxDirty: 3})
	ctx := context.Background()
	tr.Changes(ctx, root, cookies)
	for _, n := range []string{"1", "2", "3", "4", "5"} {
		put(t, filepath.Join(root, n), n)
	}
	if _, _, full := tr.Changes(ctx, root, cookies); !full {
		t.Fatal("overflow not full")
	}
	if _, _, full := tr.Changes(ctx, root, cookies); full {
		t.Fatal("full again after the overflow was answered")
	}
	if err := os.MkdirAll(filepath.Join(root, "a/inner/.git"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, _, full := tr.Changes(ctx, root, cookies); !full {
		t.Fatal("a repository inside: not full")
	}
	_ = tr.Close()
	if _, _, full := tr.Changes(ctx, root, cookies); !full {
		t.Fatal("closed: not full")
	}
}

// A directory that arrives holding a repository (moved in whole, or made
// with its .git before the watch below it was placed) makes the answer
// full, as a .git appearing later does: git add -A stages it as a
// submodule.
func TestTreesFullForARepositoryThatArrivesWithItsDirectory(t *testing.T) {
	tr, root, cookies := newTestTree(t, TreesOptions{})
	ctx := context.Background()
	tr.Changes(ctx, root, cookies)
	outside := filepath.Join(t.TempDir(), "vendor")
	if err := os.MkdirAll(filepath.Join(outside, "inner", ".git"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(outside, filepath.Join(root, "a", "vendor")); err != nil {
		t.Fatal(err)
	}
	if p, _, full := tr.Changes(ctx, root, cookies); !full {
		t.Fatalf("a repository moved in with its directory: %v, not full", p)
	}
}

// A tree idle past the limit is dropped (its watches released) and starts
// again with a full answer.
func TestTreesIdleDropped(t *testing.T) {
	now := time.Unix(1000, 0)
	tr, root, cookies := newTestTree(t, TreesOptions{Idle: time.Minute, Now: func() time.Time { return now }})
	ctx := context.Background()
	tr.Changes(ctx, root, cookies)
	if _, _, full := tr.Changes(ctx, root, cookies); full {
		t.Fatal("second answer full")
	}
	now = now.Add(2 * time.Minute)
	if _, _, full := tr.Changes(ctx, root, cookies); !full {
		t.Fatal("an idle tree kept")
	}
}

package gitsync

import (
	"context"
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

// Whatever changes the sandbox between two synced execs (a --no-sync
// command, an interrupted exec, a merge left half done) is healed by the
// next push: what it did to the files comes back first (strayEdits), then
// HEAD, index and files are as the local side has them.
func TestPushHealsChangesBetweenExecs(t *testing.T) {
	for name, change := range changesBetweenExecs() {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t, map[string]string{"a.txt": "a\n", "b.txt": "b\n"})
			writeFile(t, f.local+"/b.txt", "local b\n")
			if _, _, err := f.exec("true"); err != nil {
				t.Fatal(err)
			}
			f.inSandbox(change)
			f.pushSettled()
			assertTree(t, f.sandbox, tree(t, f.local))
			if got := strings.TrimSpace(testutil.Git(t, f.sandbox, "rev-parse", "HEAD")); got != f.base {
				t.Fatalf("sandbox HEAD %s, want base %s", got, f.base)
			}
			if st := testutil.Git(t, f.sandbox, "diff", "--cached", "--name-only"); st != "" {
				t.Fatalf("sandbox index not at base: %q", st)
			}
			if _, err := f.pull(); err != nil {
				t.Fatal(err)
			}
			for _, state := range []string{"MERGE_HEAD", "MERGE_MSG"} {
				if out := f.inSandbox("test -e .git/" + state + " && echo left || true"); out != "" {
					t.Fatalf("%s left behind", state)
				}
			}
		})
	}
}

// changesBetweenExecs are what may happen in a sandbox (on a.txt, of a.txt
// and b.txt) between two synced execs, each healed by the next push.
func changesBetweenExecs() map[string]string {
	return map[string]string{
		"tracked edit":   "echo changed > a.txt",
		"deleted file":   "rm a.txt",
		"untracked file": "mkdir -p d && echo u > d/u.txt",
		"staged only":    "echo staged > a.txt && git add a.txt && git checkout -- a.txt",
		"commit":         "echo c > c.txt && git add c.txt && git -c user.name=x -c user.email=x@x commit -q -m c",
		"merge state":    "git rev-parse HEAD > .git/MERGE_HEAD && echo merge > .git/MERGE_MSG",
		"packed refs":    "git pack-refs --all && echo changed > a.txt",
		"mode":           "chmod +x a.txt",
	}
}

// A patch that creates no path is applied to the sync index directly; the

// pushSettled pushes as the daemon does: again while the push brought
// edits back first (Again).
func (f *fixture) pushSettled() {
	f.t.Helper()
	ctx := context.Background()
	for i := 0; i < 3; i++ {
		p, err := f.s.Prepare(ctx, f.local, f.base)
		if err != nil {
			f.t.Fatalf("prepare: %v", err)
		}
		p.Sandbox = "fixture"
		res, err := f.s.Push(ctx, f.r, p)
		if err != nil {
			f.t.Fatalf("push: %v", err)
		}
		if !res.Again {
			return
		}
	}
	f.t.Fatal("the push kept bringing edits back")
}

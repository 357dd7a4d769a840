//go:build linux

package gitsync

import (
	"path/filepath"
	"strings"
	"testing"
)

// The sync's scenarios again, with the sandbox helper serving on the
// sandbox as the daemon runs it (daemon/helper): staging looks only at what
// changed once the helper's first stage is done, and every scenario's
// outcome is the same as with git add -A.
func TestScenariosWithTheSandboxHelper(t *testing.T) {
	for name, test := range syncScenarios() {
		t.Run(name, func(t *testing.T) {
			useHelper = true
			t.Cleanup(func() { useHelper = false })
			test(t)
		})
	}
}

// With the helper serving, a synced exec whose command changed nothing
// stages nothing: no git add, one git status of the paths that changed
// (the pushed file, the file the push removed), and no git diff for the
// empty pull; the user's index, as the helper left it, is not read again
// either.
func TestFusedWithTheHelperStagesOnlyWhatChanged(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	f, calls := secondExec(t)
	joined := " " + strings.Join(calls, " ") + " "
	if strings.Contains(joined, " add ") || strings.Contains(joined, " reset ") || strings.Contains(joined, " clean ") {
		t.Fatalf("a whole-tree git ran: %v", calls)
	}
	if n := strings.Count(joined, " --no-optional-locks "); n != 1 {
		t.Fatalf("%d git status, want 1 (the pull's): %v", n, calls)
	}
	if n := strings.Count(joined, " read-tree "); n != 1 {
		t.Fatalf("%d read-tree, want 1 (the checkout-like move): %v", n, calls)
	}
	// Nothing differed from the pushed tree: the pull's patch is empty
	// without a diff.
	if strings.Contains(joined, " diff ") {
		t.Fatalf("the pull ran git diff although nothing changed: %v", calls)
	}
	// A command that edits still brings its edits back.
	if _, _, err := f.exec("echo more >> b.txt"); err != nil {
		t.Fatal(err)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "b.txt"))); got != "b\nmore\n" {
		t.Fatalf("b.txt is %q locally", got)
	}
}

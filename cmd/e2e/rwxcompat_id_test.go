package e2e

import (
	"path/filepath"
	"strings"
	"testing"
)

// TestIDInsideACheckoutSyncsIt: `--id RUN` inside the run's checkout syncs
// the caller's working tree into that run, as the RWX CLI does: exec (and
// its edits come back), bg start and push; from another checkout the run is
// refused with a message (not run on a stale tree), unless --no-sync.
func TestIDInsideACheckoutSyncsIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("idsync", defaultConfig)
	run := e.startSandbox(repo)
	sub := filepath.Join(repo, "sub")
	writeFile(t, filepath.Join(sub, "f.txt"), "one\n")

	// It runs in the sandbox's sub, the caller's directory.
	r := e.mustNook(sub, "exec", "--id", run, "--", "sh", "-c", "cat f.txt; echo made > back.txt")
	if r.stdout != "one\n" {
		t.Fatalf("exec --id ran on a tree without the caller's edit: %s", r)
	}
	if got := readFile(t, filepath.Join(sub, "back.txt")); got != "made\n" {
		t.Fatalf("the edits of exec --id did not come back: %q", got)
	}

	writeFile(t, filepath.Join(sub, "f.txt"), "two\n")
	e.mustNook(repo, "bg", "start", "--id", run, "--name", "w", "--", "sleep", "300")
	if r := e.mustNook(repo, "exec", "--no-sync", "--id", run, "--", "cat", "sub/f.txt"); r.stdout != "two\n" {
		t.Fatalf("bg start --id did not sync first: %s", r)
	}
	e.mustNook(repo, "bg", "stop", "--id", run, "w")

	writeFile(t, filepath.Join(sub, "f.txt"), "three\n")
	e.mustNook(repo, "push", "--id", run)
	if r := e.mustNook(repo, "exec", "--no-sync", "--id", run, "--", "cat", "sub/f.txt"); r.stdout != "three\n" {
		t.Fatalf("push --id did not sync: %s", r)
	}

	other := e.newRepo("idsync-other", defaultConfig)
	r = e.nook(other, "exec", "--id", run, "--", "true")
	if r.code == 0 || !strings.Contains(r.stderr, "is the sandbox of "+repo) {
		t.Fatalf("exec --id from another checkout: %s, want a refusal naming the run's checkout", r)
	}
	e.mustNook(other, "exec", "--no-sync", "--id", run, "--", "true")
}

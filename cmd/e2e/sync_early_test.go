package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Through the daemon, a synced exec after an edit sends its request before
// git computed the patch (the daemon's debug log says how=early), and the
// command sees the local tree: an edit, a new file, a removal, and the
// command's own edit comes back.
func TestSyncEarlyRequestThroughTheDaemon(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.writeConfig(map[string]any{"log_level": "debug"})
	d := e.startDaemon()
	repo := e.newRepo("early", defaultConfig)
	writeFile(t, filepath.Join(repo, "gone.txt"), "to be removed\n")
	e.git(repo, "add", "-A")
	e.git(repo, "commit", "-q", "-m", "gone")
	e.git(repo, "push", "-q")
	run := e.startSandbox(repo)
	// The helper starts with the first exec; the next ones are exchanges,
	// the first of them a full scan.
	e.mustNook(repo, "exec", "--", "true")
	e.waitHelper(t, run)
	e.mustNook(repo, "exec", "--", "true")

	writeFile(t, filepath.Join(repo, "README.md"), "edited\n")
	r := e.mustNook(repo, "exec", "--", "cat", "README.md")
	if r.stdout != "edited\n" {
		t.Fatalf("the command saw README.md as %q", r.stdout)
	}
	writeFile(t, filepath.Join(repo, "new.txt"), "new\n")
	if err := os.Remove(filepath.Join(repo, "gone.txt")); err != nil {
		t.Fatal(err)
	}
	r = e.mustNook(repo, "exec", "--", "sh", "-c", "cat new.txt; test ! -e gone.txt && echo removed; echo back >back.txt")
	if r.stdout != "new\nremoved\n" {
		t.Fatalf("the command saw %q", r.stdout)
	}
	if got := readFile(t, filepath.Join(repo, "back.txt")); got != "back\n" {
		t.Fatalf("the command's edit came back as %q", got)
	}
	d.stop(t)
	if n := strings.Count(d.logs.String(), "how=early"); n < 2 {
		t.Fatalf("%d early requests, want 2; sandboxd's logs:\n%s", n, d.logs)
	}
}

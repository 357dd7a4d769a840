package e2e

import (
	"path/filepath"
	"strings"
	"testing"
)

// TestStartProgressDoesNotLeakIntoTheNextCommand: the phases of a finished
// `nook start --wait` never show in the next command's progress, even when
// that command starts another sandbox of the same checkout at once.
func TestStartProgressDoesNotLeakIntoTheNextCommand(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("leak", defaultConfig)
	writeFile(t, filepath.Join(repo, ".rwx", "other.yml"), defaultConfig)
	writeFile(t, filepath.Join(repo, ".rwx", "third.yml"), defaultConfig)
	for i, cfg := range []string{".rwx/other.yml", ".rwx/third.yml"} {
		first := e.startSandbox(repo)
		if i > 0 {
			first = decode[startJSON](t, e.mustNook(repo, "start", "--wait", "--json", ".rwx/other.yml").stdout).Session.RunID
		}
		r := e.mustNook(repo, "exec", cfg, "--", "true")
		if strings.Contains(r.stderr, first) {
			t.Fatalf("the progress of the earlier start of %s shows in the next command:\n%s", first, r)
		}
		if !strings.Contains(r.stderr, "run created") {
			t.Fatalf("the exec that started a sandbox shows no progress of its own:\n%s", r)
		}
	}
}

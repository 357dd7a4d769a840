package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// setupConfig has a setup step that writes into the checkout: a new file,
// a file in a new directory and an edit of a tracked file.
const setupConfig = `tasks:
  - key: deps
    run: |
      echo lock-from-setup > setup.lock
      mkdir -p gen && echo generated > gen/config.txt
      echo setup-line >> README.md
  - key: sandbox
    use: deps
    run: rwx-sandbox
`

// TestFirstSyncedExecBringsBackSetupFiles: what the setup steps made in the
// checkout survives the first synced exec, in the sandbox and in the local
// checkout (RWX: "the first exec also pulls back files produced by setup
// tasks"), next to the caller's own uncommitted edit.
func TestFirstSyncedExecBringsBackSetupFiles(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("setupfiles", setupConfig)
	e.startSandbox(repo)
	writeFile(t, filepath.Join(repo, "local.txt"), "mine\n")

	r := e.mustNook(repo, "exec", "--", "sh", "-c", "cat setup.lock gen/config.txt local.txt; tail -n1 README.md")
	if !strings.Contains(r.stderr, "files its setup steps made") || strings.Contains(r.stderr, "daemon stopped") {
		t.Errorf("the first exec does not say it brought back the setup's files: %s", r)
	}
	if want := "lock-from-setup\ngenerated\nmine\nsetup-line\n"; r.stdout != want {
		t.Fatalf("the first synced exec saw %q, want %q (the setup's files must survive it)\n%s", r.stdout, want, r)
	}
	for path, want := range map[string]string{"setup.lock": "lock-from-setup\n", "gen/config.txt": "generated\n", "local.txt": "mine\n", "README.md": "hello\nsetup-line\n"} {
		b, err := os.ReadFile(filepath.Join(repo, path))
		if err != nil || string(b) != want {
			t.Fatalf("local %s after the first exec: %q, %v; want %q\n%s", path, b, err, want, r)
		}
	}
	// Brought back once: a local delete is not undone by a later exec.
	if err := os.Remove(filepath.Join(repo, "setup.lock")); err != nil {
		t.Fatal(err)
	}
	r = e.mustNook(repo, "exec", "--", "sh", "-c", "ls setup.lock 2>/dev/null || echo gone")
	if strings.TrimSpace(r.stdout) != "gone" {
		t.Fatalf("a setup file deleted locally came back: %s", r)
	}
	if _, err := os.Stat(filepath.Join(repo, "setup.lock")); !os.IsNotExist(err) {
		t.Fatalf("setup.lock is back locally after it was deleted: %v", err)
	}
}

// failingSetup is RWX's own setup-failure definition.
const failingSetup = `tasks:
  - key: preflight
    run: |
      echo "intentional-setup-failure"
      exit 1
  - key: sandbox
    use: preflight
    run: rwx-sandbox
`

// TestFailedSetupSaysWhatFailedAndWhatToChange: when a setup step fails,
// nook names the step, shows its output and says to change the config;
// it never calls the command safe to retry (it would fail the same way).
func TestFailedSetupSaysWhatFailedAndWhatToChange(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("setupfails", failingSetup)
	for _, args := range [][]string{{"exec", "--", "echo", "hello"}, {"start", "--wait"}} {
		r := e.nook(repo, args...)
		out := r.stdout + r.stderr
		if r.code == 0 || strings.Contains(out, "hello") {
			t.Fatalf("nook %v with a failing setup step: %s", args, r)
		}
		for _, want := range []string{"preflight", "intentional-setup-failure", "fix the failing task in " + filepath.Join(repo, ".rwx", "sandbox.yml")} {
			if !strings.Contains(out, want) {
				t.Errorf("nook %v does not say %q:\n%s", args, want, r)
			}
		}
		if strings.Contains(out, "safe to retry") {
			t.Errorf("nook %v calls a failed setup safe to retry:\n%s", args, r)
		}
	}
}

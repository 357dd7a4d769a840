package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// TestSyncedCommandSurvivesItsExchangeHelperBeingKilled: the sandbox
// helper of a synced exec killed (SIGKILL) while its held command runs,
// the connection fine, costs the caller nothing: the daemon attaches to
// the command by id on the same connection, and the caller gets all of
// its output, its exit code and its edits, the command run once.
func TestSyncedCommandSurvivesItsExchangeHelperBeingKilled(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	d := e.startDaemon()
	repo := e.newRepo("helperkill", defaultConfig)
	run := e.startServedSandbox(t, repo)
	e.mustNook(repo, "exec", "--", "true")

	counter := counterFile(t, "helperkill")
	script := fmt.Sprintf(`echo start; echo ran >> %s; sleep 2; echo made > made.txt; echo end; echo late >&2; exit 6`, counter)
	code, out, errb := e.killMidCommand(t, d, repo, []string{"exec", "--", "sh", "-c", script}, func(*os.Process) {
		pid := newestHelperPID(run, "exchange")
		if pid == 0 {
			t.Fatalf("run %s has no exchange helper", run)
		}
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	})
	checkReattached(t, d, "the exec whose helper was killed", result{code, out, errb}, 6, "helper ended while the command ran", counter)
	if b, err := os.ReadFile(filepath.Join(repo, "made.txt")); err != nil || string(b) != "made\n" {
		t.Errorf("the command's edit did not come back: %q, %v", b, err)
	}
	if r := e.nook(repo, "exec", "--", "echo", "next"); r.code != 0 || r.stdout != "next\n" {
		t.Errorf("the exec after: %s", r)
	}
}

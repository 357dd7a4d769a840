package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// TestSyncedCommandSurvivesItsExchangeHelperBeingKilled: the sandbox
// helper of a synced exec (the relay, in whose process the exchange runs
// once it serves) killed (SIGKILL) while its held command runs, the
// connection fine, costs the caller nothing: the daemon attaches to the
// command by id on the same connection, and the caller gets all of its
// output, its exit code and its edits, the command run once.
func TestSyncedCommandSurvivesItsExchangeHelperBeingKilled(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	d := e.startDaemon()
	repo := e.newRepo("helperkill", defaultConfig)
	run := e.startServedSandbox(t, repo)
	// An exchange opens the relay, the next ones run in it.
	e.mustNook(repo, "exec", "--", "true")
	e.mustNook(repo, "exec", "--", "true")
	waitUntil(t, 20*time.Second, "the relay", func() bool { return len(relayPIDs(t, run)) > 0 })

	counter := counterFile(t, "helperkill")
	script := fmt.Sprintf(`echo start; echo ran >> %s; sleep 2; echo made > made.txt; echo end; echo late >&2; exit 6`, counter)
	code, out, errb := e.killMidCommand(t, d, repo, []string{"exec", "--", "sh", "-c", script}, func(*os.Process) {
		// (An exchange that ran in a helper of its own would not see
		// it: the check below would fail.)
		pid := newestHelperPID(run, "hold", "relay")
		if pid == 0 {
			t.Fatalf("run %s has no relay", run)
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

package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// exchangePIDs lists the `sandboxd-helper exchange` processes of run.
func exchangePIDs(run string) []int {
	var pids []int
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimSuffix(string(b), "\x00"), "\x00")
		if len(args) < 2 || args[1] != "exchange" {
			continue
		}
		if cwd, err := os.Readlink(filepath.Join(d, "cwd")); err != nil || !strings.Contains(cwd, run) {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(d))
		pids = append(pids, pid)
	}
	return pids
}

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
	c := e.nookCmd(repo, "exec", "--", "sh", "-c", script)
	out, errb := &syncBuf{}, &syncBuf{}
	c.Stdout, c.Stderr = out, errb
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Wait() }()
	t.Cleanup(func() { _ = c.Process.Kill() })
	if !waitFor(30*time.Second, func() bool { return strings.Contains(out.String(), "start") }) {
		d.stop(t)
		t.Fatalf("the command did not start: stdout %q, stderr %q\n%s", out, errb, d.logs)
	}
	pids := exchangePIDs(run)
	if len(pids) != 1 {
		t.Fatalf("exchange helpers of run %s: %v, want one", run, pids)
	}
	if err := syscall.Kill(pids[0], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var err error
	select {
	case err = <-done:
	case <-time.After(60 * time.Second):
		d.stop(t)
		t.Fatalf("the exec whose helper was killed did not end within a minute: stdout %q, stderr %q\n%s", out, errb, d.logs)
	}
	var ee *exec.ExitError
	if !asExit(err, &ee) || ee.ExitCode() != 6 || out.String() != "start\nend\n" || !strings.HasSuffix(errb.String(), "late\n") {
		d.stop(t)
		t.Fatalf("the exec whose helper was killed: %v, stdout %q, stderr %q; want exit 6, start and end, late\n%s", err, out, errb, d.logs)
	}
	if !strings.Contains(errb.String(), "helper ended while the command ran") {
		t.Errorf("stderr %q does not say the helper ended and the command was reattached", errb)
	}
	if n := strings.Count(readFileOr(counter), "ran"); n != 1 {
		t.Errorf("the command ran %d times, want once", n)
	}
	if b, err := os.ReadFile(filepath.Join(repo, "made.txt")); err != nil || string(b) != "made\n" {
		t.Errorf("the command's edit did not come back: %q, %v", b, err)
	}
	if r := e.nook(repo, "exec", "--", "echo", "next"); r.code != 0 || r.stdout != "next\n" {
		t.Errorf("the exec after: %s", r)
	}
}

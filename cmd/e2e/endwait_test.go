package e2e

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// endWaitsBehindAnExec runs `nook <verb>` while a command runs in the
// sandbox: the verb waits in the exec queue, and says on stderr and as a
// session.progress event what it waits for and since when.
func endWaitsBehindAnExec(t *testing.T, name, verb string) {
	t.Helper()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo(name, defaultConfig)
	run := e.startSandbox(repo)
	events := e.followEvents("")
	// The scratch directory is shared with the sandbox: the marker says
	// the command runs.
	marker := filepath.Join(e.root, name+".started")
	cmd := e.nookCmd(repo, "exec", "--", "sh", "-c", "touch "+marker+"; sleep 4; exit 7")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 30*time.Second, "the command to start", func() bool { _, err := os.Stat(marker); return err == nil })
	r := e.mustNook(repo, verb)
	var ee *exec.ExitError
	if err := cmd.Wait(); !errors.As(err, &ee) || ee.ExitCode() != 7 {
		t.Fatalf("the exec under nook %s ended with %v, want its own exit 7", verb, err)
	}
	line := regexp.MustCompile(`(?m)^nook: \d\d:\d\d:\d\d waiting for the command running in sandbox ` + run + ` to end before pulling its edits \(1 ahead in its queue\) since \d\d:\d\d:\d\d$`)
	if !line.MatchString(r.stderr) {
		t.Fatalf("nook %s did not say what it waited for on stderr: %s", verb, r)
	}
	events.waitFor(t, 5*time.Second, "session.progress waiting", func(ev map[string]any) bool {
		if ev["type"] != "session.progress" || ev["runId"] != run {
			return false
		}
		data, _ := ev["data"].(map[string]any)
		msg, _ := data["message"].(string)
		return data["phase"] == "waiting" && strings.HasPrefix(msg, "waiting for the command running in sandbox "+run)
	})
}

func TestStopWaitingBehindAnExecSaysWhatItWaitsFor(t *testing.T) {
	t.Parallel()
	endWaitsBehindAnExec(t, "stopwaitsay", "stop")
}

func TestResetWaitingBehindAnExecSaysWhatItWaitsFor(t *testing.T) {
	t.Parallel()
	endWaitsBehindAnExec(t, "resetwaitsay", "reset")
}

package e2e

import (
	"strings"
	"testing"
)

// TestHeldExecIsKeptByTheHelperServer: with the helper's server serving
// the checkout, a held exec starts no keeper process of its own: the
// command's ancestors are the server, not a `hold keep` (nor the `hold
// start` that asked for it), and its output and exit code reach the
// caller.
func TestHeldExecIsKeptByTheHelperServer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("keeper", defaultConfig)
	e.startServedSandbox(t, repo)
	// Each ancestor's command line, up to the sandbox's first process.
	script := `p=$$; while [ "$p" -gt 1 ]; do echo "ancestor: $(tr '\0' ' ' < /proc/$p/cmdline)"; p=$(sed -n 's/^PPid:[[:space:]]*//p' /proc/$p/status); done; exit 5`
	r := e.nook(repo, "exec", "--no-sync", "--", "sh", "-c", script)
	if r.code != 5 {
		t.Fatalf("the held exec exited %d, want the command's 5: %s", r.code, r)
	}
	var server bool
	for _, l := range strings.Split(r.stdout, "\n") {
		if !strings.HasPrefix(l, "ancestor: ") {
			continue
		}
		if strings.Contains(l, " hold ") {
			t.Errorf("a helper process of the exec's own is the command's ancestor: %s\n%s", l, r.stdout)
		}
		if strings.Contains(l, " serve -state ") {
			server = true
		}
	}
	if !server {
		t.Errorf("the helper's server is not among the held command's ancestors:\n%s", r.stdout)
	}
}

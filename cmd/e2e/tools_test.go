package e2e

import (
	"os"
	"os/exec"
	"testing"
)

// inCI is true under CI (CI=true), where every tool a test needs must be
// installed (.ci/run does it): a missing tool fails the test instead of
// skipping it.
func inCI() bool { return os.Getenv("CI") == "true" }

// needTool returns the path of an external program a test drives, or skips
// the test (fails it in CI) saying how to get it.
func needTool(t testing.TB, name, install string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err == nil {
		return p
	}
	missingTool(t, name, install)
	return ""
}

func missingTool(t testing.TB, name, install string) {
	t.Helper()
	msg := name + " is not installed (" + install + "; .ci/run installs it)"
	if inCI() {
		t.Fatalf("%s, and CI=true: the test set-up must provide it", msg)
	}
	t.Skip("skipped: " + msg)
}

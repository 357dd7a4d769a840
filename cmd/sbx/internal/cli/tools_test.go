package cli

import (
	"os"
	"os/exec"
	"testing"
)

// needTool returns the path of an external program a test drives, or skips
// the test saying how to get it; under CI (CI=true, .ci/run installs the
// tools) a missing tool fails it instead.
func needTool(t *testing.T, name, install string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err == nil {
		return p
	}
	msg := name + " is not installed (" + install + "; .ci/run installs it)"
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s, and CI=true: the test set-up must provide it", msg)
	}
	t.Skip(msg)
	return ""
}

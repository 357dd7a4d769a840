package cli

import (
	"testing"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

// needTool returns the path of an external program a test drives, or skips
// the test saying how to get it; under CI (CI=true, .ci/run installs the
// tools) a missing tool fails it instead.
func needTool(t *testing.T, name, install string) string {
	t.Helper()
	return testutil.NeedTool(t, name, install)
}

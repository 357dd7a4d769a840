package e2e

import (
	"testing"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

// inCI is true under CI (CI=true), where every tool a test needs must be
// installed (.ci/run does it): a missing tool fails the test instead of
// skipping it.
func inCI() bool { return testutil.InCI() }

// needTool returns the path of an external program a test drives, or skips
// the test (fails it in CI) saying how to get it.
func needTool(t testing.TB, name, install string) string {
	t.Helper()
	return testutil.NeedTool(t, name, install)
}

func missingTool(t testing.TB, name, install string) {
	t.Helper()
	testutil.MissingTool(t, name, install)
}

package provision

import (
	"errors"
	"strings"
	"testing"
)

// TestParseConfigRunsTheLinesBeforeRwxSandbox: a sandbox task whose script
// ends with rwx-sandbox is the sandbox task, its earlier lines one more
// step of that task; a script going on after rwx-sandbox is refused.
func TestParseConfigRunsTheLinesBeforeRwxSandbox(t *testing.T) {
	d, err := ParseConfig([]byte("tasks:\n  - key: deps\n    run: echo deps\n  - key: sandbox\n    run: |\n      echo a > setup-artifact.txt\n      echo b\n      rwx-sandbox\n"))
	if err != nil {
		t.Fatal(err)
	}
	if d.SandboxKey != "sandbox" || len(d.Steps) != 2 || d.Steps[1].Key != "sandbox" || d.Steps[1].Run != "echo a > setup-artifact.txt\necho b" {
		t.Fatalf("definition %+v", d)
	}
	_, err = ParseConfig([]byte("tasks:\n  - key: sandbox\n    run: |\n      rwx-sandbox\n      echo after\n"))
	if !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), "after `rwx-sandbox`") {
		t.Fatalf("a script going on after rwx-sandbox: %v", err)
	}
}

package agent

import (
	"os"
	"path/filepath"
	"testing"
)

// TestOpenPTYStaysInTheSandboxRoot: the sandbox's /dev is the sandbox's;
// a /dev/ptmx or /dev/pts planted there as links to this machine's never
// makes the agent open a terminal of this machine.
func TestOpenPTYStaysInTheSandboxRoot(t *testing.T) {
	root := t.TempDir()
	if err := os.Mkdir(filepath.Join(root, "dev"), 0o755); err != nil {
		t.Fatal(err)
	}
	for name, target := range map[string]string{"ptmx": "/dev/ptmx", "pts": "/dev/pts"} {
		if err := os.Symlink(target, filepath.Join(root, "dev", name)); err != nil {
			t.Fatal(err)
		}
	}
	m, tty, err := openPTY(root)
	if err == nil {
		m.Close()
		tty.Close()
		t.Fatalf("a terminal was opened through links to this machine's /dev: %s", tty.Name())
	}
	// The machine's own still works.
	m, tty, err = openPTY("")
	if err != nil {
		t.Fatal(err)
	}
	m.Close()
	tty.Close()
}

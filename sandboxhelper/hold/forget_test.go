package hold

import (
	"os"
	"path/filepath"
	"testing"
)

// Forget removes an ended exec's files and leaves a running one (and an
// id that is not one) alone.
func TestForgetRemovesAnEndedExecOnly(t *testing.T) {
	h := newHolder(t)
	running, ended := newID(t), newID(t)
	release := filepath.Join(t.TempDir(), "go")
	if err := h.Start(running, []string{"sh", "-c", "while [ ! -e " + release + " ]; do sleep 0.05; done"}); err != nil {
		t.Fatal(err)
	}
	// The release file's directory goes at the test's end: the command
	// must be seen to end before it, or it polls for ever.
	t.Cleanup(func() {
		_ = os.WriteFile(release, nil, 0o600)
		waitFor(t, "the running exec to end", func() bool { s, _ := h.State(running); return s.Ended })
	})
	if err := h.Start(ended, []string{"true"}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the short exec to end", func() bool { s, _ := h.State(ended); return s.Ended })
	if err := h.Forget(running); err != nil {
		t.Fatal(err)
	}
	if err := h.Forget(ended); err != nil {
		t.Fatal(err)
	}
	if s, _ := h.State(running); !s.Started {
		t.Fatal("a running exec was forgotten")
	}
	if s, _ := h.State(ended); s.Started {
		t.Fatal("an ended exec was kept")
	}
	if err := h.Forget("../x"); err == nil {
		t.Fatal("an id that is not one was taken")
	}
}

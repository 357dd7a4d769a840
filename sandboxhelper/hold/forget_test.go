package hold

import (
	"os"
	"path/filepath"
	"testing"
	"time"
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

// Sweep removes the execs that ended long ago, and leaves one that ended
// recently, a running one and an entry that is not an exec's.
func TestSweepRemovesOnlyExecsThatEndedLongAgo(t *testing.T) {
	h := newHolder(t)
	old, recent := newID(t), newID(t)
	for _, id := range []string{old, recent} {
		if err := h.Start(id, []string{"true"}); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "the exec to end", func() bool { s, _ := h.State(id); return s.Ended })
	}
	running := newID(t)
	release := filepath.Join(t.TempDir(), "go")
	if err := h.Start(running, []string{"sh", "-c", "while [ ! -e " + release + " ]; do sleep 0.05; done"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = os.WriteFile(release, nil, 0o600)
		waitFor(t, "the running exec to end", func() bool { s, _ := h.State(running); return s.Ended })
	})
	other := filepath.Join(h.Root, "not-an-exec")
	if err := os.MkdirAll(other, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(other, "status"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	long := now.Add(-48 * time.Hour)
	for _, p := range []string{filepath.Join(h.Root, old, "status"), filepath.Join(other, "status")} {
		if err := os.Chtimes(p, long, long); err != nil {
			t.Fatal(err)
		}
	}
	// The running exec's directory is old too: only a status counts.
	if err := os.Chtimes(filepath.Join(h.Root, running), long, long); err != nil {
		t.Fatal(err)
	}
	n, err := h.Sweep(24*time.Hour, now)
	if err != nil || n != 1 {
		t.Fatalf("Sweep removed %d (%v), want 1", n, err)
	}
	for id, want := range map[string]bool{old: false, recent: true, running: true, "not-an-exec": true} {
		if _, err := os.Stat(filepath.Join(h.Root, id)); (err == nil) != want {
			t.Errorf("after the sweep, %s there: %v, want %v", id, err == nil, want)
		}
	}
}

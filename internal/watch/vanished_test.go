package watch

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestVanishedDirectoryStopsBeingPolledAfterABound deletes a watched
// checkout: its files are polled for VanishedFor, then no more, and asking
// for the file again polls it anew.
func TestVanishedDirectoryStopsBeingPolledAfterABound(t *testing.T) {
	w, logs := newWatcher(t, Options{VanishedFor: 150 * time.Millisecond})
	dir := filepath.Join(t.TempDir(), "repo")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "sandbox.yml")
	write(t, file, "v1")
	c := newCounter()
	cancel, err := w.WatchFile(file, c.onChange)
	if err != nil {
		t.Fatal(err)
	}
	defer cancel()
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	c.expectOne(t)
	if _, polled := w.Watching(); polled != 1 {
		t.Fatalf("the file of the deleted directory must be polled at first, polled=%d", polled)
	}
	deadline := time.Now().Add(waitLimit)
	for {
		if _, polled := w.Watching(); polled == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the file of a directory gone for long is still polled; logs:\n%s", logs)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if !strings.Contains(logs.String(), "no longer polling") {
		t.Fatalf("no log line says polling stopped; logs:\n%s", logs)
	}
	// A new watch of the file (the checkout is back) polls it again.
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	c2 := newCounter()
	cancel2, err := w.WatchFile(file, c2.onChange)
	if err != nil {
		t.Fatal(err)
	}
	defer cancel2()
	write(t, file, "v2")
	c2.expectOne(t)
}

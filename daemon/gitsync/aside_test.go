package gitsync

import (
	"errors"
	"fmt"
	"strings"
	"syscall"
	"testing"
)

// TestDiskFullErrorIsNotCalledSafeToRetry: the exec route calls an error
// before the command safe to retry unless it has NoRetryHint; a full disk
// fails again until space is freed, wrapped or not.
func TestDiskFullErrorIsNotCalledSafeToRetry(t *testing.T) {
	de := &DiskFullError{Dir: "/repo", Need: 2 << 20, Cause: fmt.Errorf("write big.txt: %w", syscall.ENOSPC)}
	wrapped := fmt.Errorf("sync your changes to the sandbox: %w", de)
	var noRetry interface{ NoRetryHint() bool }
	if !errors.As(wrapped, &noRetry) || !noRetry.NoRetryHint() {
		t.Fatal("a full disk must not be called safe to retry")
	}
	if !errors.Is(wrapped, syscall.ENOSPC) {
		t.Fatal("the cause must stay reachable")
	}
	msg := wrapped.Error()
	for _, want := range []string{"no space left on the disk of /repo", "working tree is as it was", "stay in the sandbox", "free at least 2 MiB"} {
		if !strings.Contains(msg, want) {
			t.Errorf("message %q lacks %q", msg, want)
		}
	}
	de.Saved = "/repo/.git/sandboxd/pulls/x.patch"
	if !strings.Contains(de.Error(), "saved at /repo/.git/sandboxd/pulls/x.patch") {
		t.Errorf("a saved patch is not named: %s", de)
	}
}

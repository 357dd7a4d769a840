//go:build linux

package sandboxhelper

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// serveAt runs a server on a fresh checkout directory with idle, returning
// its state directory and the channel of its end.
func serveAt(t *testing.T, ctx context.Context, state string, idle time.Duration) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- ServeIdle(ctx, filepath.Dir(filepath.Dir(state)), state, idle, io.Discard, nil) }()
	return done
}

func newState(t *testing.T) string {
	t.Helper()
	isolate(t)
	root := t.TempDir()
	state := filepath.Join(root, ".git", "sandboxd")
	if err := os.MkdirAll(state, 0o755); err != nil {
		t.Fatal(err)
	}
	return state
}

// TestPingFindsTheServerOfTheCheckoutAndOnlyWhileItRuns: the server names
// itself where Ping finds it, answers, and is no longer found once it
// ended.
func TestPingFindsTheServerOfTheCheckoutAndOnlyWhileItRuns(t *testing.T) {
	state := newState(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := serveAt(t, ctx, state, time.Hour)
	inst, err := Ping(context.Background(), state, 10*time.Second)
	if err != nil {
		t.Fatalf("ping found no server: %v", err)
	}
	if !hexName(inst, 64) {
		t.Fatalf("ping answered instance %q", inst)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("serve: %v", err)
	}
	if got, err := Ping(context.Background(), state, 0); err == nil {
		t.Fatalf("ping found server %s after it ended", got)
	}
}

// TestServerExitsWhenAskedNothingForItsIdleTime: a server nobody asks
// ends by itself (nothing else ends a managed process while the run
// lasts), and each question puts that off.
func TestServerExitsWhenAskedNothingForItsIdleTime(t *testing.T) {
	state := newState(t)
	idle := 600 * time.Millisecond
	start := time.Now()
	done := serveAt(t, context.Background(), state, idle)
	if _, err := Ping(context.Background(), state, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	// Questions for twice the idle time keep it.
	for time.Since(start) < 2*idle {
		if _, err := Ping(context.Background(), state, 0); err != nil {
			t.Fatalf("the server ended while asked: %v", err)
		}
		time.Sleep(idle / 4)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("serve: %v", err)
		}
	case <-time.After(10 * idle):
		t.Fatalf("the server did not exit within %v of its last question", 10*idle)
	}
}

// TestASecondServerOfTheCheckoutLeavesTheFirstServing: one server per
// checkout; another started for it exits with ErrServing.
func TestASecondServerOfTheCheckoutLeavesTheFirstServing(t *testing.T) {
	old := lockWait
	lockWait = 200 * time.Millisecond
	t.Cleanup(func() { lockWait = old })
	state := newState(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first := serveAt(t, ctx, state, time.Hour)
	inst, err := Ping(context.Background(), state, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	second := serveAt(t, ctx, state, time.Hour)
	select {
	case err := <-second:
		if !errors.Is(err, ErrServing) {
			t.Fatalf("the second server ended with %v, want ErrServing", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the second server did not give up within 10s")
	}
	if got, err := Ping(context.Background(), state, 0); err != nil || got != inst {
		t.Fatalf("after the second server, ping = %q, %v; want the first, %s", got, err, inst)
	}
	cancel()
	<-first
}

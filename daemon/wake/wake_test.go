package wake

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

// fakeClocks are a wall and a monotonic clock a test moves apart.
type fakeClocks struct {
	wall time.Time
	mono time.Duration
	net  string
	err  error
}

func (f *fakeClocks) tick(d time.Duration) { f.wall = f.wall.Add(d); f.mono += d }

func (f *fakeClocks) watcher() *Watcher {
	return New(Options{
		Interval: time.Second, Threshold: 2 * time.Second,
		Wall:    func() time.Time { return f.wall },
		Mono:    func() time.Duration { return f.mono },
		Network: func() (string, error) { return f.net, f.err },
	})
}

// TestWatcherSeesSleepStopAndNetworkChange: a wall clock that jumps past
// the monotonic one is a sleep, a look that comes far too late a stopped
// daemon, other interface addresses a network change; regular looks, a
// little lateness and a failed look at the network are nothing.
func TestWatcherSeesSleepStopAndNetworkChange(t *testing.T) {
	f := &fakeClocks{wall: time.Date(2026, 1, 1, 11, 0, 0, 0, time.UTC), net: "eth0=10.0.0.2/24"}
	w := f.watcher()
	if r := w.Check(); r != "" {
		t.Fatalf("first look: %q", r)
	}
	for range 5 {
		f.tick(time.Second)
		if r := w.Check(); r != "" {
			t.Fatalf("a regular look: %q", r)
		}
	}
	f.tick(2500 * time.Millisecond) // late, within the threshold
	if r := w.Check(); r != "" {
		t.Fatalf("a slightly late look: %q", r)
	}

	// Suspended for 30 s: the monotonic clock stood still.
	f.wall = f.wall.Add(31 * time.Second)
	f.mono += time.Second
	if r := w.Check(); !strings.Contains(r, "slept for 30s") {
		t.Fatalf("after a suspend: %q", r)
	}
	f.tick(time.Second)
	if r := w.Check(); r != "" {
		t.Fatalf("the look after a wake: %q", r)
	}

	// Stopped for 30 s (SIGSTOP): both clocks went on.
	f.tick(31 * time.Second)
	if r := w.Check(); !strings.Contains(r, "not running for 30s") {
		t.Fatalf("after a stop: %q", r)
	}

	f.tick(time.Second)
	f.err = errors.New("netlink busy")
	if r := w.Check(); r != "" {
		t.Fatalf("a failed look at the network: %q", r)
	}
	f.err = nil
	f.tick(time.Second)
	f.net = "wlan0=192.168.1.7/24"
	if r := w.Check(); r != "the network changed" {
		t.Fatalf("after a change of network: %q", r)
	}
	f.tick(time.Second)
	if r := w.Check(); r != "" {
		t.Fatalf("the look after a change of network: %q", r)
	}
}

// TestRunCallsOnWakeForAStoppedProcess: Run, on real clocks, reports a
// look that came late because the process was not scheduled.
func TestRunCallsOnWakeForAStoppedProcess(t *testing.T) {
	start := time.Now()
	var skip time.Duration
	woke := make(chan string, 1)
	w := New(Options{
		Interval: 20 * time.Millisecond, Threshold: 100 * time.Millisecond,
		// The monotonic clock skips 5 s once, as if the process had been
		// stopped between two ticks.
		Mono: func() time.Duration {
			d := time.Since(start) + skip
			if time.Since(start) > 100*time.Millisecond {
				skip = 5 * time.Second
			}
			return d
		},
		Wall:   func() time.Time { return start.Round(0).Add(time.Since(start) + skip) },
		OnWake: func(r string) { woke <- r },
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx)
	select {
	case r := <-woke:
		if !strings.Contains(r, "not running") {
			t.Fatalf("reason %q", r)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no wake reported")
	}
}

// TestInterfaceAddrsLeavesLoopbackOut fingerprints this machine's network.
func TestInterfaceAddrsLeavesLoopbackOut(t *testing.T) {
	p, err := InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(p, "127.0.0.1") {
		t.Fatalf("loopback in the fingerprint: %q", p)
	}
}

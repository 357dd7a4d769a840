package reconcile

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

// manualClock hands out timers the test fires by hand and records the
// durations asked for.
type manualClock struct {
	mu     sync.Mutex
	asked  []time.Duration
	timers chan chan time.Time
}

func newManualClock() *manualClock { return &manualClock{timers: make(chan chan time.Time, 16)} }

func (c *manualClock) After(d time.Duration) <-chan time.Time {
	ch := make(chan time.Time, 1)
	c.mu.Lock()
	c.asked = append(c.asked, d)
	c.mu.Unlock()
	c.timers <- ch
	return ch
}

// fire waits for the loop to arm a timer and fires it.
func (c *manualClock) fire(t *testing.T) {
	t.Helper()
	select {
	case ch := <-c.timers:
		ch <- time.Now()
	case <-time.After(5 * time.Second):
		t.Fatal("the loop did not arm its timer")
	}
}

func (c *manualClock) durations() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]time.Duration(nil), c.asked...)
}

type fakePasser struct {
	passes chan struct{}
	mu     sync.Mutex
	errs   []error
}

func (f *fakePasser) Pass(ctx context.Context) error {
	f.mu.Lock()
	var err error
	if len(f.errs) > 0 {
		err, f.errs = f.errs[0], f.errs[1:]
	}
	f.mu.Unlock()
	f.passes <- struct{}{}
	return err
}

func (f *fakePasser) wait(t *testing.T) {
	t.Helper()
	select {
	case <-f.passes:
	case <-time.After(5 * time.Second):
		t.Fatal("no pass ran")
	}
}

func TestLoopBacksOffAfterFailuresAndResets(t *testing.T) {
	clock := newManualClock()
	boom := errors.New("503 from the remote")
	p := &fakePasser{passes: make(chan struct{}, 16), errs: []error{boom, boom, nil}}
	l := New(p, Options{Interval: 10 * time.Second, MaxBackoff: time.Minute, Clock: clock, Rand: func() float64 { return 0.5 }})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { l.Run(ctx); close(done) }()
	for range 3 {
		clock.fire(t)
		p.wait(t)
	}
	clock.fire(t) // the fourth wait is armed after the success
	p.wait(t)
	cancel()
	<-done
	got := clock.durations()
	want := []time.Duration{10 * time.Second, 20 * time.Second, 40 * time.Second, 10 * time.Second}
	for i, w := range want {
		if got[i] != w {
			t.Fatalf("wait %d = %s, want %s (all: %v)", i, got[i], w, got)
		}
	}
}

func TestLoopBackoffIsCappedAndJittered(t *testing.T) {
	l := New(&fakePasser{}, Options{Interval: 10 * time.Second, MaxBackoff: 30 * time.Second, Jitter: 0.2, Rand: func() float64 { return 0 }})
	if d := l.next(10); d != 24*time.Second {
		t.Fatalf("capped backoff with jitter -20%% = %s, want 24s", d)
	}
	l.opts.Rand = func() float64 { return 0.999999 }
	if d := l.next(0); d < 11*time.Second || d > 12*time.Second {
		t.Fatalf("jittered interval = %s, want about 12s", d)
	}
}

func TestTriggerRunsAPassWithoutWaiting(t *testing.T) {
	clock := newManualClock()
	p := &fakePasser{passes: make(chan struct{}, 16)}
	l := New(p, Options{Interval: time.Hour, Clock: clock})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go l.Run(ctx)
	l.Trigger()
	p.wait(t)
}

package sessions

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/daemon/events"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// fakeClock is the manager's clock in these tests.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time  { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *fakeClock) set(t time.Time) { c.mu.Lock(); c.t = t; c.mu.Unlock() }

// recordedEvents keeps what the manager publishes.
type recordedEvents struct {
	mu  sync.Mutex
	evs []recordedEvent
}

type recordedEvent struct {
	typ  string
	data any
}

func (r *recordedEvents) Publish(typ, sessionID, runID string, data any) ipc.Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.evs = append(r.evs, recordedEvent{typ, data})
	return ipc.Event{}
}

func (r *recordedEvents) of(typ string) []any {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []any
	for _, e := range r.evs {
		if e.typ == typ {
			out = append(out, e.data)
		}
	}
	return out
}

// expiryFixture is a manager with a fake clock whose pull before expiry
// is counted instead of reaching a sandbox.
type expiryFixture struct {
	m     *Manager
	s     *store.Session
	clock *fakeClock
	evs   *recordedEvents
	base  time.Time

	mu    sync.Mutex
	pulls int
	fail  error // the next pulls fail with it
}

func newExpiryFixture(t *testing.T, lead time.Duration) *expiryFixture {
	t.Helper()
	m, st := newTestManager(t, newFakeRemoteAPI(t), time.Second)
	f := &expiryFixture{m: m, evs: &recordedEvents{}, base: time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)}
	f.clock = &fakeClock{t: f.base}
	m.now = f.clock.Now
	m.opts.Events = f.evs
	m.daemonCfg.PullBeforeExpiry = lead
	m.expiryPull = func(ctx context.Context, s *store.Session) (ipc.EndEdits, error) {
		f.mu.Lock()
		defer f.mu.Unlock()
		f.pulls++
		if f.fail != nil {
			return ipc.EndEdits{}, f.fail
		}
		return ipc.EndEdits{RunID: s.RunID, PulledFiles: []string{"made-over-ssh.txt"}}, nil
	}
	f.s = insertSession(t, st, "run-expiring", store.StateReady)
	return f
}

// reportEnd is the remote reporting the run's end at base+d.
func (f *expiryFixture) reportEnd(d time.Duration) {
	r := f.m.rt(f.s.ID)
	f.m.mu.Lock()
	r.expiresAt = f.base.Add(d)
	f.m.mu.Unlock()
}

// passAt runs one pass of the pull before expiry at base+d and waits for
// the pulls it started; it returns how many pulls there were in all.
func (f *expiryFixture) passAt(d time.Duration) int {
	f.clock.set(f.base.Add(d))
	f.m.expiryPass(context.Background())
	f.m.wg.Wait()
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pulls
}

func TestPullBeforeExpiryRunsOnceTheLeadTimeBeforeTheReportedEnd(t *testing.T) {
	f := newExpiryFixture(t, 2*time.Minute)
	f.reportEnd(10 * time.Minute)
	if n := f.passAt(7*time.Minute + 59*time.Second); n != 0 {
		t.Fatalf("pulled %d times 2m01s before the end, want none yet", n)
	}
	if n := f.passAt(8 * time.Minute); n != 1 {
		t.Fatalf("pulled %d times 2m before the end, want once", n)
	}
	evs := f.evs.of(events.SessionExpiring)
	if len(evs) != 1 {
		t.Fatalf("%d session.expiring events, want 1", len(evs))
	}
	ev := evs[0].(ipc.Expiring)
	if !ev.ExpiresAt.Equal(f.base.Add(10*time.Minute)) || len(ev.PulledFiles) != 1 || ev.Error != "" {
		t.Fatalf("session.expiring = %+v, want the end and the pulled file", ev)
	}
	in := f.m.info(f.s)
	if in.ExpiresAt == nil || !in.ExpiresAt.Equal(f.base.Add(10*time.Minute)) || in.ExpiryPulledAt == nil || !in.ExpiryPulledAt.Equal(f.base.Add(8*time.Minute)) {
		t.Fatalf("the session's view says expires %v, pulled %v", in.ExpiresAt, in.ExpiryPulledAt)
	}
	if n := f.passAt(9 * time.Minute); n != 1 {
		t.Fatalf("pulled %d times, want once for one reported end", n)
	}
	// The remote moves the end: another pull, the lead time before it.
	f.reportEnd(20 * time.Minute)
	if n := f.passAt(17*time.Minute + 59*time.Second); n != 1 {
		t.Fatalf("pulled %d times before the moved end's lead time, want 1", n)
	}
	if in := f.m.info(f.s); in.ExpiryPulledAt != nil {
		t.Fatalf("the view says the moved end was pulled for at %v", in.ExpiryPulledAt)
	}
	if n := f.passAt(18*time.Minute + 30*time.Second); n != 2 {
		t.Fatalf("pulled %d times in the moved end's lead time, want 2", n)
	}
	// An end already past (a daemon that slept through it) is not pulled
	// for: the run is gone.
	f.reportEnd(30 * time.Minute)
	if n := f.passAt(31 * time.Minute); n != 2 {
		t.Fatalf("pulled %d times after the end, want still 2", n)
	}
}

func TestPullBeforeExpiryWaitsForTheRunningCommand(t *testing.T) {
	f := newExpiryFixture(t, 2*time.Minute)
	f.reportEnd(10 * time.Minute)
	release, err := f.m.sandboxOf(f.s).line.Acquire(context.Background(), func(int) {})
	if err != nil {
		t.Fatal(err)
	}
	f.clock.set(f.base.Add(9 * time.Minute))
	f.m.expiryPass(context.Background())
	time.Sleep(300 * time.Millisecond)
	f.mu.Lock()
	early := f.pulls
	f.mu.Unlock()
	if early != 0 {
		t.Fatal("the pull before expiry ran while a command held the sandbox's queue")
	}
	release()
	f.m.wg.Wait()
	if f.pulls != 1 {
		t.Fatalf("pulled %d times once the command ended, want once", f.pulls)
	}
}

func TestFailedPullBeforeExpiryIsSaidAndTriedAgainUntilTheEnd(t *testing.T) {
	f := newExpiryFixture(t, 2*time.Minute)
	f.reportEnd(10 * time.Minute)
	f.fail = errors.New("the sandbox did not answer")
	if n := f.passAt(8 * time.Minute); n != 1 {
		t.Fatalf("pulled %d times, want 1", n)
	}
	evs := f.evs.of(events.SessionExpiring)
	if len(evs) != 1 || evs[0].(ipc.Expiring).Error == "" {
		t.Fatalf("a failed pull before expiry is not said: %+v", evs)
	}
	if n := f.passAt(8*time.Minute + 10*time.Second); n != 1 {
		t.Fatalf("tried again %d times within %s of the failure", n-1, expiryRetry)
	}
	f.fail = nil
	if n := f.passAt(8*time.Minute + expiryRetry); n != 2 {
		t.Fatalf("pulled %d times after %s, want a second try", n, expiryRetry)
	}
	if n := f.passAt(9 * time.Minute); n != 2 {
		t.Fatalf("pulled %d times after a success, want 2", n)
	}
}

func TestPullBeforeExpiryIsOffAtZeroAndWithoutAReportedEnd(t *testing.T) {
	f := newExpiryFixture(t, 0)
	f.reportEnd(10 * time.Minute)
	if n := f.passAt(9 * time.Minute); n != 0 {
		t.Fatalf("pulled %d times with pull_before_expiry 0", n)
	}
	g := newExpiryFixture(t, 2*time.Minute)
	if n := g.passAt(9 * time.Minute); n != 0 {
		t.Fatalf("pulled %d times with no reported end", n)
	}
	if in := g.m.info(g.s); in.ExpiresAt != nil {
		t.Fatalf("the view reports an end no remote reported: %v", in.ExpiresAt)
	}
}

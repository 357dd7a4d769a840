package sessions

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/store"
)

// DefaultLockIdle is how long the agent lock stays held after this daemon's
// last exec on a sandbox.
const DefaultLockIdle = 250 * time.Millisecond

// Through a burst of execs the lock is given up at an exec boundary (the
// agent grants it in request order, so a waiting client goes first) and
// asked for again at once. Nothing tells this daemon that another client
// waits, and learning whether one took the lock costs round trips that the
// burst's next exec waits for; so the yield comes once the burst has held
// the lock for LockIdle and served lockBurstExecs execs, or at the latest
// after lockBurstHolds times LockIdle. A burst then pays the yield on a
// small share of its execs, and a client on another machine waits at most
// lockBurstHolds × LockIdle (2 s by default) plus the exec that is running.
const (
	lockBurstExecs = 32
	lockBurstHolds = 8
)

// lease holds the sandbox agent's lock across a burst of this daemon's
// execs on one run. Execs on a run are serialized by the controller's exec
// line, so at most one uses the lease at a time; the release runs after
// LockIdle without an exec, in the controller's loop, off every caller's
// path.
type lease struct {
	owner     *sandbox
	mu        sync.Mutex
	conn      *sshpool.Conn // the connection that holds the agent lock; nil when not held
	since     time.Time     // when conn took the lock
	uses      int           // execs served since conn took the lock
	busy      bool          // an exec uses the lease
	gen       uint64        // bumped on every use: a stale task does nothing
	task      leaseTask     // what the controller's loop does next, and when
	releasing chan struct{} // closed once an unlock in flight is answered
	// acquiring is closed once the lock request that follows a yield is
	// answered (or given up); cancelAcquire gives it up.
	acquiring     chan struct{}
	cancelAcquire context.CancelFunc
	// lost is this daemon's connection that held the lock and was lost
	// without a confirmed unlock (nil when none): what a lock request may
	// wait for.
	lost *lostHolder
}

// leaseTask is the lease's next step, run by the controller's loop at at
// if the lease is still at generation gen.
type leaseTask struct {
	kind    int
	gen     uint64
	at      time.Time
	session *store.Session
}

const (
	taskNone    = iota
	taskRelease // send the unlock (release)
	taskYield   // give the lock up and ask for it again (yield)
)

// leaseFor returns the lease of session s, creating its controller on
// first use.
func (m *Manager) leaseFor(s *store.Session) *lease {
	return &m.sandboxOf(s).lease
}

// lockSandbox connects and makes sure the agent lock is held by the
// connection it returns: at once when this daemon's lease still holds it,
// else with a lock request. done must be called when the exec is over; it
// starts the idle countdown of the lease.
//
// The lock request is the first use of a connection that may have died
// while idle; taking the lock is safe to repeat on a new connection (the
// agent releases a lock whose connection closed), so a broken connection
// gets one more try.
func (m *Manager) lockSandbox(ctx context.Context, s *store.Session) (conn *sshpool.Conn, done func(), err error) {
	l := m.leaseFor(s)
	l.mu.Lock()
	l.busy = true
	l.gen++
	l.uses++
	l.task = leaseTask{}
	releasing, acquiring := l.releasing, l.acquiring
	l.mu.Unlock()
	done = func() { m.leaseIdle(l, s) }
	// An unlock on its way: a lock request racing it on another channel
	// could be answered first and then undone. A lock request on its way
	// (after a yield): its answer is this exec's lock.
	for _, ch := range []chan struct{}{releasing, acquiring} {
		if ch == nil {
			continue
		}
		select {
		case <-ch:
		case <-ctx.Done():
			done()
			return nil, nil, fmt.Errorf("acquire the sandbox lock: %w", ctx.Err())
		}
	}
	conn, err = m.takeLock(ctx, s, l)
	if err != nil {
		done()
		return nil, nil, err
	}
	return conn, done, nil
}

// lockAttempts bounds the tries to take the lock when connections break
// before it is granted (taking it again on a new connection is safe: the
// agent frees the lock of a connection that closed).
const lockAttempts = 3

// takeLock returns a connection holding the agent lock for lease l.
func (m *Manager) takeLock(ctx context.Context, s *store.Session, l *lease) (*sshpool.Conn, error) {
	lockTimeout, _ := m.waitBounds()
	since := m.now()
	deadline := time.Now().Add(lockTimeout)
	for attempt := 0; ; attempt++ {
		conn, err := m.connectSaying(ctx, s)
		if err != nil {
			return nil, err
		}
		l.mu.Lock()
		held := l.conn == conn
		if !held {
			// The pool has another connection than the one that held the
			// lock: that one is gone, maybe without the agent knowing.
			m.noteLostHolderLocked(l)
		}
		l.mu.Unlock()
		if held {
			return conn, nil
		}
		err = m.requestLock(ctx, s, l, conn, since, deadline)
		if err == nil {
			l.mu.Lock()
			l.conn, l.since, l.lost, l.uses = conn, m.now(), nil, 0
			if l.busy {
				l.uses = 1
			}
			l.mu.Unlock()
			l.owner.setState(stateLeased, "the agent lock was granted")
			return conn, nil
		}
		if lt := (*lockTimeoutError)(nil); errors.As(err, &lt) {
			return nil, err // the message says it all
		}
		if attempt >= lockAttempts-1 || ctx.Err() != nil || !(errors.Is(err, sshpool.ErrConnectionLost) || errors.Is(err, sshpool.ErrNotSent)) {
			return nil, fmt.Errorf("acquire the sandbox lock: %w", err)
		}
		m.log.Info("connection broke before the lock was granted; reconnecting", "run", s.RunID, "err", err)
		// The pool may hand back the broken connection until it has
		// noticed the break: give it a moment before the next try.
		select {
		case <-time.After(time.Duration(attempt+1) * 100 * time.Millisecond):
		case <-ctx.Done():
			return nil, fmt.Errorf("acquire the sandbox lock: %w", ctx.Err())
		}
	}
}

// relock takes the lock again on a fresh connection, for a command that
// could not be sent on the connection that held it.
func (m *Manager) relock(ctx context.Context, s *store.Session) (*sshpool.Conn, error) {
	l := m.leaseFor(s)
	l.mu.Lock()
	l.conn = nil
	l.mu.Unlock()
	return m.takeLock(ctx, s, l)
}

// leaseIdle ends an exec's use of the lease: the lock is released after
// LockIdle unless another exec comes first (at once when the manager is
// closing, or when a burst held it long enough: then it is asked for
// again at once, see yieldDue and yield).
func (m *Manager) leaseIdle(l *lease, s *store.Session) {
	l.mu.Lock()
	l.busy = false
	l.gen++
	if l.conn == nil {
		l.mu.Unlock()
		return
	}
	t := leaseTask{kind: taskRelease, gen: l.gen, at: time.Now().Add(m.opts.LockIdle), session: s}
	if m.isClosing() {
		// The controller's loop may be gone already: release from here.
		l.mu.Unlock()
		l.owner.spawn(func() { m.release(l, s.RunID, t.gen) })
		return
	}
	if m.yieldDue(l) {
		t.kind, t.at = taskYield, time.Time{}
	}
	l.task = t
	l.mu.Unlock()
	l.owner.poke()
}

// yieldDue says a burst has held l's lock long enough to give it up at
// this exec boundary. The caller holds l.mu.
func (m *Manager) yieldDue(l *lease) bool {
	held := m.now().Sub(l.since)
	return held >= lockBurstHolds*m.opts.LockIdle || held >= m.opts.LockIdle && l.uses >= lockBurstExecs
}

// yield gives the lock up after a burst held it long enough, so that a
// client waiting for it goes first (the agent grants it in request order),
// and asks for it again at once: the burst's next exec then finds it held,
// or waits for that request instead of paying an unlock and a lock round
// trip on its own path. Taken back with no exec coming, it is released
// after LockIdle as usual.
func (m *Manager) yield(l *lease, s *store.Session, gen uint64) {
	m.release(l, s.RunID, gen)
	l.mu.Lock()
	if l.gen != gen || l.conn != nil || l.acquiring != nil || m.isClosing() {
		// An exec came first (it takes the lock itself), the session is
		// stopping (releaseNow), or the manager is closing.
		l.mu.Unlock()
		return
	}
	ch := make(chan struct{})
	ctx, cancel := context.WithCancel(l.owner.ctx)
	l.acquiring, l.cancelAcquire = ch, cancel
	l.mu.Unlock()
	_, err := m.takeLock(ctx, s, l)
	cancel()
	if err != nil {
		m.log.Debug("take the sandbox lock again after yielding it", "run", s.RunID, "err", err)
	}
	l.mu.Lock()
	l.acquiring, l.cancelAcquire = nil, nil
	if err == nil && !l.busy {
		l.gen++
		l.task = leaseTask{kind: taskRelease, gen: l.gen, at: time.Now().Add(m.opts.LockIdle), session: s}
	}
	l.mu.Unlock()
	close(ch)
}

// release sends the unlock if the lease is still idle at generation gen,
// and waits for its answer (bounded by unlockTimeout).
func (m *Manager) release(l *lease, runID string, gen uint64) {
	l.mu.Lock()
	if l.busy || l.gen != gen || l.conn == nil {
		l.mu.Unlock()
		return
	}
	conn, since := l.conn, l.since
	l.conn, l.task = nil, leaseTask{}
	ch := make(chan struct{})
	l.releasing = ch
	l.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), unlockTimeout)
	// A connection that went silent gets no unlock through: the probe
	// closes it, which ends the unlock, instead of the next exec waiting
	// for unlockTimeout.
	_, probeTimeout := m.waitBounds()
	var probe sync.WaitGroup
	probe.Go(func() { _ = conn.Probe(ctx, probeTimeout) })
	// On this connection only: the lock is this connection's, and a closed
	// connection has released it already.
	st, err := conn.ExecOnce(ctx, directiveUnlock, sshpool.Stdio{})
	cancel()
	probe.Wait()
	lost := err != nil
	if err == nil && st.Code != 0 {
		err = fmt.Errorf("agent refused %s (exit %d)", directiveUnlock, st.Code)
	}
	if err != nil {
		m.log.Debug("release the sandbox lock", "run", runID, "err", err)
	}
	l.mu.Lock()
	if lost && l.lost == nil {
		// The unlock did not get through: the agent may hold the lock for
		// that connection until it notices it is gone.
		l.lost = &lostHolder{since: since, lost: m.now()}
	}
	l.releasing = nil
	l.mu.Unlock()
	close(ch)
	if lost {
		l.owner.setState(stateReconnecting, "the unlock did not get through")
	} else {
		l.owner.setState(stateReady, "the agent lock was released")
	}
}

// releaseNow releases the lock of controller c now if it is held and
// idle, and waits for the answer (stop, shutdown).
func (m *Manager) releaseNow(c *sandbox) {
	l := &c.lease
	l.mu.Lock()
	// A new generation: a yield on its way does not ask for the lock
	// again, and one that asks already gives up (it may wait behind
	// another client for as long as that one holds the lock).
	l.gen++
	if l.cancelAcquire != nil {
		l.cancelAcquire()
	}
	l.task = leaseTask{}
	acquiring := l.acquiring
	l.mu.Unlock()
	if acquiring != nil {
		<-acquiring
	}
	l.mu.Lock()
	gen := l.gen
	releasing := l.releasing
	l.mu.Unlock()
	if releasing != nil {
		<-releasing
	}
	c.mu.Lock()
	runID := c.runID
	c.mu.Unlock()
	m.release(l, runID, gen)
}

// endAll releases every idle lease and ends every controller (the daemon
// is stopping).
func (m *Manager) endAll(ctx context.Context) {
	m.mu.Lock()
	m.closing = true
	all := make([]*sandbox, 0, len(m.sandboxes))
	for _, c := range m.sandboxes {
		all = append(all, c)
	}
	m.mu.Unlock()
	var wg sync.WaitGroup
	for _, c := range all {
		wg.Go(func() { c.end("the daemon is stopping") })
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
	}
}

func (m *Manager) isClosing() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.closing
}

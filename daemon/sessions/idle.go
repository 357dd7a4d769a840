package sessions

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sandboxd/sandboxd/daemon/events"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// The idle stop: a ready sandbox that nothing used for idle_stop (no exec
// or shell, no SSH session through the daemon, no forward traffic, no
// background process running) is stopped, its edits pulled first. Holds
// (an exec, an SSH session) make it busy for as long as they last; touches
// (a push, a forward's bytes, a background command) restart its idle time.

// idleState is the idle stop's view of one session (in sessionRuntime).
type idleState struct {
	lastActive time.Time // zero: not seen yet (then the last exec or the creation)
	holds      int       // execs and SSH sessions open now
	warned     bool      // session.idle_warning sent for this idle period
	stopping   bool      // an idle stop of the session is under way
}

// idleWarnLead is how long before the idle stop its warning is published
// (half the idle stop when that is shorter).
const idleWarnLead = time.Minute

// idleStopTimeout bounds the pull and stop of one idle sandbox.
const idleStopTimeout = 5 * time.Minute

func warnLead(stop time.Duration) time.Duration { return min(idleWarnLead, stop/2) }

// idleTick is how often the idle stop looks at the sandboxes.
func idleTick(stop time.Duration) time.Duration {
	if stop <= 0 {
		return 30 * time.Second // only to notice a reloaded configuration
	}
	return min(max(stop/8, 100*time.Millisecond), 15*time.Second)
}

func (m *Manager) idleStop() time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.daemonCfg.IdleStop
}

// touch records a use of session id now: its idle time starts again.
func (m *Manager) touch(id string) {
	if id == "" {
		return
	}
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	r := &m.sandboxLocked(id).rt
	r.idle.lastActive, r.idle.warned = now, false
}

// hold marks session id busy until the returned release is called.
func (m *Manager) hold(id string) (release func()) {
	r := m.rt(id)
	m.mu.Lock()
	r.idle.holds++
	m.mu.Unlock()
	m.touch(id)
	var once sync.Once
	return func() {
		once.Do(func() {
			m.mu.Lock()
			r.idle.holds--
			m.mu.Unlock()
			m.touch(id)
		})
	}
}

// idleFor reports how long session s has been unused, or busy when
// something holds it. m.mu must be held.
func (m *Manager) idleForLocked(s *store.Session, now time.Time) (idle time.Duration, busy bool) {
	r, _ := m.runtimeLocked(s.ID)
	last := latest(s.CreatedAt, s.LastExecAt)
	if r != nil {
		if r.idle.holds > 0 || r.idle.stopping {
			return 0, true
		}
		last = latest(last, r.idle.lastActive)
	}
	return max(now.Sub(last), 0), false
}

// idleInfo fills the idle fields of a ready session's public view.
func (m *Manager) idleInfo(s *store.Session, in *ipc.SessionInfo) {
	if s.State != store.StateReady {
		return
	}
	now := m.now()
	m.mu.Lock()
	idle, busy := m.idleForLocked(s, now)
	stop := m.daemonCfg.IdleStop
	m.mu.Unlock()
	if busy {
		return
	}
	secs := int64(idle / time.Second)
	in.IdleSeconds = &secs
	if stop > 0 && !s.Kept {
		at := now.Add(max(stop-idle, 0))
		in.IdleStopAt = &at
	}
}

// RunIdleStop stops idle sandboxes until ctx ends (the daemon's services
// run it). The configured idle_stop is read at each tick, and a reload
// starts a tick at once.
func (m *Manager) RunIdleStop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-m.idleNow:
		case <-time.After(idleTick(m.idleStop())):
		}
		m.idlePass(ctx)
	}
}

// idlePass warns about, and stops, the sandboxes idle for long enough.
func (m *Manager) idlePass(ctx context.Context) {
	stop := m.idleStop()
	if stop <= 0 || m.isClosing() {
		return
	}
	all, err := m.st.List()
	if err != nil {
		m.log.Warn("idle stop: list sessions", "err", err)
		return
	}
	now := m.now()
	for _, s := range all {
		if s.State != store.StateReady || s.Kept || s.RunID == "" {
			continue
		}
		r := m.rt(s.ID)
		m.mu.Lock()
		idle, busy := m.idleForLocked(s, now)
		warn := !busy && idle >= stop-warnLead(stop) && !r.idle.warned
		if warn {
			r.idle.warned = true
		}
		start := !busy && idle >= stop
		if start {
			r.idle.stopping = true
		}
		m.mu.Unlock()
		if warn {
			m.publish(events.SessionIdleWarning, s, ipc.IdleWarning{IdleSeconds: int64(idle / time.Second), StopsAt: now.Add(max(stop-idle, 0))})
		}
		if start {
			m.wg.Add(1)
			go func() {
				defer m.wg.Done()
				m.stopIdle(ctx, s, stop)
			}()
		}
	}
}

// stopIdle stops session s, idle for stop, unless it turns out to work: a
// background process runs, or it was used meanwhile. The sandbox's edits
// are pulled first; when they cannot be, it is not stopped.
func (m *Manager) stopIdle(ctx context.Context, s *store.Session, stop time.Duration) {
	ctx, cancel := context.WithTimeout(ctx, idleStopTimeout)
	defer cancel()
	r := m.rt(s.ID)
	stopped := false
	defer func() {
		m.mu.Lock()
		r.idle.stopping = false
		m.mu.Unlock()
		if !stopped {
			// Busy after all, or the pull failed: a new idle period.
			m.touch(s.ID)
		}
	}()
	log := m.log.With("session", s.ID, "run", s.RunID)
	if busy, why := m.backgroundBusy(ctx, s); busy {
		log.Debug("idle stop: the sandbox works", "why", why)
		return
	}
	// The exec queue: nothing runs while the edits are pulled and the run
	// ended; an exec waiting here finds the session ended.
	release, err := m.sandboxOf(s).line.Acquire(ctx, nil)
	if err != nil {
		log.Warn("idle stop: wait for the sandbox's queue", "err", err)
		return
	}
	defer release()
	cur, err := m.st.Get(s.ID)
	if err != nil || cur.State != store.StateReady || cur.Kept {
		return
	}
	m.mu.Lock()
	lastActive := r.idle.lastActive
	holds := r.idle.holds
	m.mu.Unlock()
	if holds > 0 || m.now().Sub(latest(lastActive, cur.LastExecAt, cur.CreatedAt)) < stop {
		return // used while the background processes were asked about
	}
	pulled, err := m.pullBeforeStop(ctx, cur)
	if err != nil {
		log.Warn("idle stop: the sandbox's edits could not be pulled; it is kept", "err", err)
		m.publish(events.SessionIdleWarning, cur, map[string]any{"error": fmt.Sprintf("not stopped: its edits could not be pulled (%v); it is tried again after another %s idle", err, stop)})
		return
	}
	reason := fmt.Sprintf("stopped after %s idle (idle_stop)", stop)
	if _, err := m.stopSession(ctx, cur, reason); err != nil {
		log.Warn("idle stop: end the run", "err", err)
		return
	}
	stopped = true
	log.Info("stopped an idle sandbox", "idle_stop", stop, "pulled_files", len(pulled.PulledFiles), "saved_patch", pulled.SavedPatch)
}

// backgroundBusy reports whether a background process runs in session s's
// sandbox. When the agent cannot tell, a session with background records
// counts as busy: never stop a sandbox that may work.
func (m *Manager) backgroundBusy(ctx context.Context, s *store.Session) (bool, string) {
	conn, err := m.connect(ctx, s)
	if err != nil {
		return true, "cannot reach the sandbox: " + err.Error()
	}
	listed, ok := m.agentProcesses(ctx, conn)
	if ok {
		for name, rec := range listed {
			if rec.Status == "running" || rec.Status == "starting" {
				return true, "background process " + name + " runs"
			}
		}
		return false, ""
	}
	for _, bg := range s.Background {
		rec, err := m.processDirective(ctx, conn, directiveProcessStatus, map[string]any{"key": bg.Name})
		if err != nil || rec.Status == "running" || rec.Status == "starting" {
			return true, "background process " + bg.Name + " may run"
		}
	}
	return false, ""
}

// Keep pins (or with Off unpins) the caller's sandbox against the idle
// stop; pinning also starts a new idle period.
func (m *Manager) Keep(ctx context.Context, req ipc.KeepRequest) (ipc.KeepResponse, error) {
	s, _, err := m.lookupBranch(ctx, req.Target)
	if err != nil {
		return ipc.KeepResponse{}, err
	}
	if s.State.Terminal() {
		return ipc.KeepResponse{}, endedError(s)
	}
	kept := !req.Off
	updated, err := m.st.Update(s.ID, func(s *store.Session) error { s.Kept = kept; return nil })
	if err != nil {
		return ipc.KeepResponse{}, fmt.Errorf("record that the sandbox is kept: %w", err)
	}
	m.touch(s.ID)
	return ipc.KeepResponse{Session: m.info(updated)}, nil
}

// heldConn is a connection that holds its session busy until it closes
// (an SSH session through the daemon).
type heldConn struct {
	net.Conn
	release func()
}

func (c *heldConn) Close() error {
	c.release()
	return c.Conn.Close()
}

// touchConn is a connection whose reads and writes are uses of its session
// (a port forward's traffic), recorded at most every touchEvery.
type touchConn struct {
	net.Conn
	touch func()
	last  atomic.Int64 // unix nanoseconds of the last recorded use
}

const touchEvery = 100 * time.Millisecond

func (c *touchConn) used() {
	now := time.Now().UnixNano()
	if last := c.last.Load(); now-last >= int64(touchEvery) && c.last.CompareAndSwap(last, now) {
		c.touch()
	}
}

func (c *touchConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 {
		c.used()
	}
	return n, err
}

func (c *touchConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if n > 0 {
		c.used()
	}
	return n, err
}

// CloseWrite keeps half-closes working through the wrapper.
func (c *touchConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// latest is the latest of ts.
func latest(ts ...time.Time) time.Time {
	var l time.Time
	for _, t := range ts {
		if t.After(l) {
			l = t
		}
	}
	return l
}

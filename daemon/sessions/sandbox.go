package sessions

import (
	"context"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/daemon/events"
	"github.com/sandboxd/sandboxd/daemon/execq"
	"github.com/sandboxd/sandboxd/daemon/relay"
	"github.com/sandboxd/sandboxd/store"
)

// sandboxState is where a sandbox's controller is.
type sandboxState int

const (
	// stateConnecting: no connection to the sandbox has come up yet.
	stateConnecting sandboxState = iota
	// stateReady: connected, and this daemon does not hold the agent lock.
	stateReady
	// stateLeased: this daemon holds the agent lock (lease.go).
	stateLeased
	// stateReconnecting: the kept connection dropped; the pool redials.
	stateReconnecting
	// stateEnded: the session ended or the daemon closes; final.
	stateEnded
)

func (s sandboxState) String() string {
	switch s {
	case stateConnecting:
		return "connecting"
	case stateReady:
		return "ready"
	case stateLeased:
		return "leased"
	case stateReconnecting:
		return "reconnecting"
	case stateEnded:
		return "ended"
	}
	return "unknown"
}

// sandbox is the controller of one session's sandbox: it owns what the
// daemon keeps about it at run time, which a restart re-learns: the exec
// line, the kept connection (a link of daemon/sshpool), the lease on the
// agent lock, the local port forwards (a set of daemon/forward) and the
// ones that could not be reopened, the runtime facts (rehydration check,
// config drift, expiry, poll errors, idle use) and the exec statistics not
// yet written. Its state changes in one place (setState), which logs and
// publishes the change; the one goroutine it runs (the lease's timers,
// run) and every goroutine it starts (spawn) are joined by end. It follows
// the connection's ups and downs through connectionChanged, and keeps the
// relay of its held execs (package relay). The helper's
// state stays daemon/helper's, keyed by connection, and the sync's
// daemon/gitsync's.
type sandbox struct {
	m  *Manager
	id string // session id

	mu        sync.Mutex
	runID     string
	state     sandboxState
	since     time.Time         // when state was entered (the manager's clock; zero: at creation)
	fwdFailed map[string]string // why a stored forward could not be reopened, by name
	closed    bool              // end began: spawn runs nothing more
	looping   bool              // run was started

	rt    sessionRuntime // guarded by m.mu
	lease lease          // guarded by lease.mu
	line  *execq.Line
	link  Link       // the kept connection (daemon/sshpool)
	fwds  ForwardSet // its local port forwards (daemon/forward); nil without Options.Forwards
	// relays is the relay of its held execs on the kept connection
	// (package relay).
	relays  *relay.Slot
	tally   execTally // guarded by m.records
	pending bool      // tally is in m.pending; guarded by m.records

	wake   chan struct{} // the lease's task changed
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// newSandbox returns the controller of session id. Its loop starts with
// the first task of its lease (a controller of a session that never runs a
// command costs no goroutine).
func newSandbox(m *Manager, id string) *sandbox {
	ctx, cancel := context.WithCancel(context.Background())
	c := &sandbox{m: m, id: id, state: stateConnecting, line: execq.NewLine(),
		wake: make(chan struct{}, 1), ctx: ctx, cancel: cancel, relays: relay.NewSlot(m.log)}
	c.link = m.opts.Pool.NewLink(c.connectionChanged)
	c.lease.owner = c
	if m.opts.Forwards != nil {
		c.fwds = m.opts.Forwards.NewSet()
	}
	return c
}

// sandboxLocked returns session id's controller, creating it on first use.
// m.mu must be held.
func (m *Manager) sandboxLocked(id string) *sandbox {
	c, ok := m.sandboxes[id]
	if !ok {
		c = newSandbox(m, id)
		m.sandboxes[id] = c
	}
	return c
}

// sandboxOf returns the controller of session s, creating it on first use.
func (m *Manager) sandboxOf(s *store.Session) *sandbox {
	m.mu.Lock()
	c := m.sandboxLocked(s.ID)
	m.mu.Unlock()
	if s.RunID != "" {
		c.mu.Lock()
		c.runID = s.RunID
		c.mu.Unlock()
	}
	return c
}

// sandboxIfAny returns session id's controller, nil when it has none.
func (m *Manager) sandboxIfAny(id string) *sandbox {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.sandboxes[id]
}

// runtimeLocked returns the runtime facts of session id, if it has a
// controller. m.mu must be held.
func (m *Manager) runtimeLocked(id string) (*sessionRuntime, bool) {
	if c, ok := m.sandboxes[id]; ok {
		return &c.rt, true
	}
	return nil, false
}

// setState is the one place where a controller's state changes: it logs
// the change and publishes it (sandbox.state). An ended controller stays
// ended.
func (c *sandbox) setState(to sandboxState, why string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	from := c.state
	if from == to || from == stateEnded {
		return
	}
	c.state, c.since = to, c.m.now()
	level := "info"
	if to == stateLeased || from == stateLeased {
		level = "debug" // once per burst of execs
	}
	args := []any{"session", c.id, "run", c.runID, "from", from.String(), "to", to.String(), "why", why}
	if level == "debug" {
		c.m.log.Debug("sandbox state", args...)
	} else {
		c.m.log.Info("sandbox state", args...)
	}
	// Under c.mu: subscribers see the changes in the order they happened.
	c.m.opts.Events.Publish(events.SandboxState, c.id, c.runID, map[string]string{"state": to.String(), "from": from.String(), "reason": why})
}

// current returns the controller's state and since when it holds.
func (c *sandbox) current() (sandboxState, time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.state, c.since
}

// connectionChanged follows the kept connection (its link's state
// callback): down is reconnecting; up is ready after connecting or
// reconnecting. A leased controller stays leased on an up: the callback
// runs in the pool's goroutine and may come after the lock request that
// the new connection carried.
func (c *sandbox) connectionChanged(up bool, err error) {
	if up {
		if st, _ := c.current(); st == stateConnecting || st == stateReconnecting {
			c.setState(stateReady, "connected")
		}
		return
	}
	why := "the connection dropped"
	if err != nil {
		why += ": " + err.Error()
	}
	c.setState(stateReconnecting, why)
}

// spawn runs f in a goroutine that end joins; once end began, f runs in
// the caller's goroutine instead.
func (c *sandbox) spawn(f func()) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		f()
		return
	}
	c.wg.Add(1)
	c.mu.Unlock()
	go func() {
		defer c.wg.Done()
		f()
	}()
}

// poke tells the loop that the lease's task changed, starting it first.
func (c *sandbox) poke() {
	c.mu.Lock()
	if !c.looping && !c.closed {
		c.looping = true
		c.wg.Add(1)
		go c.run()
	}
	c.mu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// run is the controller's loop: it runs the lease's task (the idle
// release, the yield of a burst) when it is due, until end.
func (c *sandbox) run() {
	defer c.wg.Done()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		c.lease.mu.Lock()
		t := c.lease.task
		var wait time.Duration
		if t.kind != taskNone {
			if wait = time.Until(t.at); wait <= 0 {
				c.lease.task = leaseTask{}
			}
		}
		c.lease.mu.Unlock()
		var due <-chan time.Time
		if t.kind != taskNone {
			if wait <= 0 {
				c.runTask(t)
				continue
			}
			timer.Reset(wait)
			due = timer.C
		}
		select {
		case <-c.ctx.Done():
			return
		case <-c.wake:
			timer.Stop()
		case <-due:
		}
	}
}

// runTask runs one due task of the lease.
func (c *sandbox) runTask(t leaseTask) {
	switch t.kind {
	case taskRelease:
		c.m.release(&c.lease, t.session.RunID, t.gen)
	case taskYield:
		c.m.yield(&c.lease, t.session, t.gen)
	}
}

// end enters the ended state, releases the lock if held and joins every
// goroutine of the controller (each is bounded: an unlock by
// unlockTimeout, a yield's lock request by the cancel). Ended first: an
// unlock that fails on a connection already forgotten says nothing more.
func (c *sandbox) end(why string) {
	c.setState(stateEnded, why)
	c.m.releaseNow(c)
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	c.relays.Close()
	c.cancel()
	c.wg.Wait()
}

// setForwardFailed records why forward name could not be reopened ("":
// it was).
func (c *sandbox) setForwardFailed(name, why string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if why == "" {
		delete(c.fwdFailed, name)
		return
	}
	if c.fwdFailed == nil {
		c.fwdFailed = make(map[string]string)
	}
	c.fwdFailed[name] = why
}

// forwardFailure says why forward name could not be reopened.
func (c *sandbox) forwardFailure(name string) string {
	if c == nil {
		return ""
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.fwdFailed[name]
}

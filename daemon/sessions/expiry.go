package sessions

import (
	"context"
	"time"

	"github.com/sandboxd/sandboxd/daemon/events"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// The pull before expiry: when a remote reports when a run ends (expires_at
// in its connection info, learnt when the session becomes ready and at each
// reconcile; the local remote reports it, RWX Cloud does not), the
// sandbox's edits are pulled pull_before_expiry ahead of that end, so that
// what was made in it outside an exec does not end with the run. It is the
// pull a stop does, in the exec queue; once per reported end (an end that
// moves gets another), tried again until the end while it fails. Edits made
// after it come back with the next exec as usual.

// expiryState is the pull before expiry's view of one session.
type expiryState struct {
	pulledFor time.Time // the reported end whose pull is done
	pulledAt  time.Time
	failedAt  time.Time // the last failed try, for pulledFor's successor
	pulling   bool
}

// expiryTick is how often the reported ends are looked at: a look reads
// the runtime records only.
const expiryTick = time.Second

// expiryRetry is how long after a failed pull it is tried again.
const expiryRetry = 15 * time.Second

// dueExpiry is a session whose pull before expiry is due.
type dueExpiry struct {
	id string
	at time.Time // the reported end
}

// RunExpiryPull pulls the sandboxes' edits ahead of their reported ends
// until ctx ends (the daemon's services run it).
func (m *Manager) RunExpiryPull(ctx context.Context) {
	t := time.NewTicker(expiryTick)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		m.expiryPass(ctx)
	}
}

// expiryPass starts the pulls that are due now, each in the background.
func (m *Manager) expiryPass(ctx context.Context) {
	if m.isClosing() {
		return
	}
	for _, d := range m.expiryDue(m.now()) {
		m.wg.Add(1)
		go func() {
			defer m.wg.Done()
			m.pullForExpiry(ctx, d)
		}()
	}
}

// expiryDue returns the sessions whose reported end is within
// pull_before_expiry of now, not yet pulled for, and marks them pulling.
func (m *Manager) expiryDue(now time.Time) []dueExpiry {
	m.mu.Lock()
	defer m.mu.Unlock()
	lead := m.daemonCfg.PullBeforeExpiry
	if lead <= 0 {
		return nil
	}
	var due []dueExpiry
	for id, c := range m.sandboxes {
		r := &c.rt
		at, x := r.expiresAt, &r.expiry
		switch {
		case at.IsZero() || x.pulling || x.pulledFor.Equal(at):
		case now.Before(at.Add(-lead)) || !now.Before(at):
			// Not yet; or over (a daemon that slept through it): the
			// run is gone, its reconcile says so.
		case !x.failedAt.IsZero() && now.Sub(x.failedAt) < expiryRetry:
		default:
			x.pulling = true
			due = append(due, dueExpiry{id: id, at: at})
		}
	}
	return due
}

// pullForExpiry pulls session d.id's edits before its run ends at d.at,
// and says so with a session.expiring event.
func (m *Manager) pullForExpiry(ctx context.Context, d dueExpiry) {
	r := m.rt(d.id)
	done := false
	defer func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		r.expiry.pulling = false
		if done {
			r.expiry.pulledFor, r.expiry.pulledAt, r.expiry.failedAt = d.at, m.now(), time.Time{}
		} else {
			r.expiry.failedAt = m.now()
		}
	}()
	s, err := m.st.Get(d.id)
	if err != nil || s.State != store.StateReady || s.RunID == "" {
		done = true // nothing to pull from
		return
	}
	log := m.log.With("session", s.ID, "run", s.RunID, "expires_at", d.at)
	// Bounded as a stop's pull is, and by the end itself: past it there
	// is no sandbox to pull from.
	ctx, cancel := context.WithTimeout(ctx, min(max(d.at.Sub(m.now()), time.Second), endPullTimeout))
	defer cancel()
	// In the exec queue: a running command ends first (its edits come
	// back with it) and the pull never overlaps one.
	release, err := m.sandboxOf(s).line.Acquire(ctx, func(int) {})
	if err != nil {
		log.Warn("pull before expiry: wait for the sandbox's queue", "err", err)
		m.publish(events.SessionExpiring, s, ipc.Expiring{ExpiresAt: d.at, PulledFiles: []string{}, Error: "a command still runs in the sandbox; its edits come back with it"})
		return
	}
	defer release()
	if s, err = m.st.Get(d.id); err != nil || s.State != store.StateReady {
		done = true
		return
	}
	e, err := m.expiryPull(ctx, s)
	ev := ipc.Expiring{ExpiresAt: d.at, PulledFiles: e.PulledFiles, SavedPatch: e.SavedPatch, Warnings: e.Warnings}
	if ev.PulledFiles == nil {
		ev.PulledFiles = []string{}
	}
	if err != nil {
		log.Warn("pull before expiry", "err", err)
		ev.Error = err.Error() + "; tried again until the run ends"
		m.publish(events.SessionExpiring, s, ev)
		return
	}
	done = true
	log.Info("pulled the sandbox's edits before its run ends", "files", len(e.PulledFiles), "saved_patch", e.SavedPatch)
	m.publish(events.SessionExpiring, s, ev)
}

// expiryInfo fills the expiry fields of a session's public view.
func (m *Manager) expiryInfo(s *store.Session, in *ipc.SessionInfo) {
	if s.State.Terminal() {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.runtimeLocked(s.ID)
	if !ok || r.expiresAt.IsZero() {
		return
	}
	at := r.expiresAt
	in.ExpiresAt = &at
	if !r.expiry.pulledAt.IsZero() && r.expiry.pulledFor.Equal(at) {
		p := r.expiry.pulledAt
		in.ExpiryPulledAt = &p
	}
}

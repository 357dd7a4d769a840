package sessions

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/sandboxd/sandboxd/rwxapi"

	"github.com/sandboxd/sandboxd/daemon/runsapi"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// Polling bounds when the remote gives no or silly backoff hints.
const (
	minPoll = 100 * time.Millisecond
	maxPoll = 5 * time.Second
)

// waitProgressInterval is how often a waiter that reports progress looks at
// the poller's latest failure; waitReminder how often an unchanged failure
// is repeated.
const (
	waitProgressInterval = time.Second
	waitReminder         = 30 * time.Second
)

// waitReady waits until session s is sandboxable. Concurrent waiters of one
// session share one poller. timeout 0 means the configured default.
func (m *Manager) waitReady(ctx context.Context, s *store.Session, timeout time.Duration) (*store.Session, error) {
	return m.waitReadyReporting(ctx, s, timeout, nil)
}

// waitReadyReporting is waitReady telling report (when not nil) about the
// remote's failures as they happen, so that a caller never waits minutes in
// silence on a failing remote.
func (m *Manager) waitReadyReporting(ctx context.Context, s *store.Session, timeout time.Duration, report func(string)) (*store.Session, error) {
	// A record just read and ready needs no second read (the exec path).
	if m.awaitCheck(ctx, s.ID) || s.State != store.StateReady {
		if cur, err := m.st.Get(s.ID); err == nil {
			s = cur
		}
	}
	if s.State == store.StateReady {
		return s, nil
	}
	if s.State.Terminal() {
		return s, endedError(s)
	}
	if timeout <= 0 {
		timeout = m.opts.WaitTimeout
	}
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	type result struct {
		s   *store.Session
		err error
	}
	done := make(chan result, 1)
	go func() {
		r, err := m.readies.do(wctx, s.ID, m.opts.WaitTimeout, func(ctx context.Context) (*store.Session, error) {
			return m.pollReady(ctx, s.ID)
		})
		done <- result{r, err}
	}()
	var tick <-chan time.Time
	if report != nil {
		t := time.NewTicker(waitProgressInterval)
		defer t.Stop()
		tick = t.C
	}
	var ready *store.Session
	var err error
	lastMsg, lastAt := "", time.Time{}
wait:
	for {
		select {
		case r := <-done:
			ready, err = r.s, r.err
			break wait
		case <-tick:
			n, perr := m.pollFailure(s.ID)
			if perr == nil {
				continue
			}
			if msg := perr.Error(); msg != lastMsg || m.now().Sub(lastAt) >= waitReminder {
				report(fmt.Sprintf("the remote failed %d time(s) in a row while sandbox %s gets ready (last: %v); still retrying until %s have passed; Ctrl-C stops waiting", n, s.RunID, remoteAdvice(perr), timeout))
				lastMsg, lastAt = msg, m.now()
			}
		}
	}
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
			return s, errdefs.Timeout(fmt.Errorf("sandbox run %s is not ready after %s; it may still be provisioning (see %s`nook status`)", s.RunID, timeout, urlOr(m.browserURL(s.RunURL))))
		}
		return s, err
	}
	return ready, nil
}

// pollReady asks the remote for the connection info of session id until the
// run is sandboxable or over, honouring the remote's backoff hint.
func (m *Manager) pollReady(ctx context.Context, id string) (*store.Session, error) {
	said := "\x00" // the provisioning step last published: once per change
	for {
		s, err := m.st.Get(id)
		if err != nil {
			return nil, err
		}
		if s.State.Terminal() {
			return s, endedError(s)
		}
		if s.RunID == "" {
			return s, errdefs.Conflictf("session %s has no run yet: its create did not finish; run `nook start` again", s.ID)
		}
		remote, err := m.remote(ctx)
		if err != nil {
			return s, err
		}
		ci, err := m.connectionInfo(ctx, remote, s)
		wait := minPoll
		switch {
		case err == nil && ci.Sandboxable:
			return m.markReady(s, ci)
		case err == nil && ci.Polling.Completed:
			return m.endedBeforeReady(ctx, remote, s, ci.FailureReason)
		case err == nil:
			wait = time.Duration(ci.Polling.BackoffMs) * time.Millisecond
			if ci.Status != said {
				said = ci.Status
				m.progress(s, ipc.PhaseProvisioning, ci.Status)
			}
		case definitelyOver(err):
			s = m.expire(s, remoteReason(err))
			return s, endedError(s)
		default:
			m.log.Debug("connection info failed, retrying", "run", s.RunID, "err", err)
			m.notePollFailure(id, err)
			wait = time.Second
		}
		if err == nil {
			m.notePollFailure(id, nil)
		}
		wait = min(max(wait, minPoll), maxPoll)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return s, ctx.Err()
		case <-t.C:
		}
	}
}

// notePollFailure records the remote's latest failure while polling session
// id for readiness (nil: it answered).
func (m *Manager) notePollFailure(id string, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.runtimeLocked(id)
	if !ok {
		if err == nil {
			return
		}
		r = &m.sandboxLocked(id).rt
	}
	r.pollErr = err
	if err == nil {
		r.pollErrs = 0
	} else {
		r.pollErrs++
	}
}

// pollFailure is the latest failure recorded by notePollFailure.
func (m *Manager) pollFailure(id string) (n int, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if r, ok := m.runtimeLocked(id); ok {
		return r.pollErrs, r.pollErr
	}
	return 0, nil
}

// remoteAdvice is err as said to the user (finding 8 adds what to do).
func remoteAdvice(err error) string { return err.Error() }

// connectionInfo asks with the session's scoped token, falling back to the
// account token when the scoped one was refused (expired).
func (m *Manager) connectionInfo(ctx context.Context, remote Remote, s *store.Session) (rwxapi.ConnectionInfo, error) {
	ci, err := remote.ConnectionInfo(ctx, s.RunID, s.Token)
	if err != nil && s.Token != "" && errors.Is(err, errdefs.ErrUnauthorized) {
		ci, err = remote.ConnectionInfo(ctx, s.RunID, "")
	}
	return ci, err
}

// moved reports whether a sandboxable run's agent is no longer where (or
// with the keys) session s knows it.
func moved(s *store.Session, ci rwxapi.ConnectionInfo) bool {
	return ci.Sandboxable && (ci.Address != s.Address || ci.PublicHostKey != s.PublicHostKey || ci.PrivateUserKey != s.PrivateUserKey)
}

// definitelyOver reports whether err is the remote's definite word that a run
// is over or was never there (404, 410): the only answers that prune.
func definitelyOver(err error) bool {
	return errors.Is(err, errdefs.ErrGone) || errors.Is(err, errdefs.ErrNotFound)
}

func remoteReason(err error) string {
	var apiErr *runsapi.APIError
	if errors.As(err, &apiErr) && apiErr.Message != "" {
		return apiErr.Message
	}
	return err.Error()
}

// markReady records the connection facts of a sandboxable run and starts
// keeping a connection to it.
func (m *Manager) markReady(s *store.Session, ci rwxapi.ConnectionInfo) (*store.Session, error) {
	wasReady := s.State == store.StateReady
	s, err := m.st.Update(s.ID, func(s *store.Session) error {
		s.Address, s.PublicHostKey, s.PrivateUserKey = ci.Address, ci.PublicHostKey, ci.PrivateUserKey
		s.State, s.StateReason = store.StateReady, ""
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("record sandbox connection info: %w", err)
	}
	r := m.rt(s.ID)
	m.mu.Lock()
	r.expiresAt = time.Time{}
	if t, err := time.Parse(time.RFC3339, ci.ExpiresAt); err == nil {
		r.expiresAt = t
	}
	m.mu.Unlock()
	if !wasReady {
		m.progress(s, ipc.PhaseConnecting, s.Address)
	}
	m.sandboxOf(s).link.Ensure(target(s))
	m.watchConfig(s)
	if !wasReady {
		m.publish(eventSessionReady, s, map[string]string{"address": s.Address})
		m.progress(s, ipc.PhaseReady, "")
	}
	return s, nil
}

// expire records that the remote says session s's run is over.
func (m *Manager) expire(s *store.Session, reason string) *store.Session {
	return m.end(s, store.StateExpired, reason, eventSessionExpired)
}

// end moves session s to a terminal state, closes its connection and stops
// watching its files.
func (m *Manager) end(s *store.Session, state store.State, reason, event string) *store.Session {
	// Only the call that ends it says so: a stop and an expiry can race
	// (the stop's own end of the run drops the connection, whose reconnect
	// asks the remote), each holding a snapshot from before the other.
	moved := false
	updated, err := m.st.Update(s.ID, func(s *store.Session) error {
		if s.State.Terminal() {
			return nil
		}
		s.State, s.StateReason = state, reason
		moved = true
		return nil
	})
	if err != nil {
		m.log.Error("record session end", "session", s.ID, "err", err)
		updated, moved = s, !s.State.Terminal()
	}
	m.closeRunForwards(s)
	if c := m.sandboxIfAny(s.ID); c != nil {
		c.link.Forget()
	}
	m.dropRuntime(s.ID)
	if moved {
		m.publish(event, updated, map[string]string{"reason": reason})
		m.cliFileChanged(s.RepoRoot)
	}
	return updated
}

// endedError says that session s's run is over and what to do.
func endedError(s *store.Session) error {
	reason := s.StateReason
	if reason == "" {
		reason = string(s.State)
	}
	return errdefs.Gone(fmt.Errorf("sandbox run %s has ended (%s): run the command again to start a new sandbox, or `nook reset`", s.RunID, reason))
}

// CheckAlive tells the SSH pool whether a run is still worth reconnecting
// to: an error of kind gone ends the reconnect attempts (and the session);
// transient errors are returned as unavailable so the pool keeps trying.
func (m *Manager) CheckAlive(ctx context.Context, runID string) error {
	s, err := m.st.ByRunID(runID)
	if err != nil {
		return errdefs.Gone(fmt.Errorf("no session for run %s: %w", runID, err))
	}
	if s.State.Terminal() {
		return endedError(s)
	}
	if m.isStopping(s.ID) {
		// The stop ends the session itself, as stopped, not expired.
		return errdefs.Unavailable(fmt.Errorf("sandbox run %s is being stopped", runID))
	}
	remote, err := m.remote(ctx)
	if err != nil {
		return err
	}
	ci, err := m.connectionInfo(ctx, remote, s)
	switch {
	case err != nil && definitelyOver(err):
		return endedError(m.expire(s, remoteReason(err)))
	case err != nil:
		return errdefs.Unavailable(err)
	case ci.Polling.Completed && !ci.Sandboxable: // RWX marks a ready sandbox completed too
		return endedError(m.expire(s, "the run is over"))
	case moved(s, ci):
		// The agent moved (the local remote restarted, say): record where
		// it is now, which also points the pool's reconnects there.
		_, err := m.markReady(s, ci)
		return err
	}
	return nil
}

// SessionOfRun returns the session id of a run ("" when unknown), for
// labelling connection events.
func (m *Manager) SessionOfRun(runID string) string {
	if s, err := m.st.ByRunID(runID); err == nil {
		return s.ID
	}
	return ""
}

// urlOr is "url or " to precede another place to look, or nothing.
func urlOr(url string) string {
	if url == "" {
		return ""
	}
	return url + " or "
}

// parenthesized is " (url)", or nothing.
func parenthesized(url string) string {
	if url == "" {
		return ""
	}
	return " (" + url + ")"
}

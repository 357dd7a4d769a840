package sessions

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// stopTimeout bounds stopping one run.
const stopTimeout = 30 * time.Second

// Stop ends the caller's sandbox (or the one of --id, or all of them). It is
// idempotent: stopping what is already over succeeds and reports nothing new.
func (m *Manager) Stop(ctx context.Context, req ipc.StopRequest) (ipc.StopResponse, error) {
	var targets []*store.Session
	switch {
	case req.All:
		all, err := m.st.List()
		if err != nil {
			return ipc.StopResponse{}, err
		}
		for _, s := range all {
			if !s.State.Terminal() {
				targets = append(targets, s)
			}
		}
	default:
		s, _, err := m.lookupBranch(ctx, req.Target)
		if errors.Is(err, errdefs.ErrNotFound) && req.RunID != "" {
			// A run sandboxd never knew is a mistake (a typo, another
			// machine's run), not an already-stopped sandbox.
			return ipc.StopResponse{}, errdefs.NotFoundf("run %s is unknown to sandboxd: `nook list --all` lists the runs it knows", req.RunID)
		}
		if errors.Is(err, errdefs.ErrNotFound) {
			return ipc.StopResponse{Stopped: []ipc.SessionInfo{}}, nil
		}
		if err != nil {
			return ipc.StopResponse{}, err
		}
		targets = append(targets, s)
	}
	resp := ipc.StopResponse{Stopped: []ipc.SessionInfo{}}
	var errs []error
	for _, s := range targets {
		if s.State.Terminal() {
			continue
		}
		// The sandbox's edits come back first (or, with Discard, are
		// listed as dropped); when they cannot, it is not stopped.
		e, err := m.endEdits(ctx, s, req.Discard)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if e.PulledFiles != nil || e.SavedPatch != "" || e.Discarded != nil || len(e.Warnings) > 0 {
			resp.Edits = append(resp.Edits, e)
		}
		stopped, err := m.stopSession(ctx, s, "stopped by the user")
		if err != nil {
			errs = append(errs, err)
			continue
		}
		resp.Stopped = append(resp.Stopped, m.info(stopped))
	}
	return resp, errors.Join(errs...)
}

// stopSession ends one run: __rwx_sandbox_end__ for a sandboxable run,
// cancel for one still provisioning (or whose agent cannot be reached).
func (m *Manager) stopSession(ctx context.Context, s *store.Session, reason string) (*store.Session, error) {
	ctx, cancel := context.WithTimeout(ctx, stopTimeout)
	defer cancel()
	m.setStopping(s.ID, true)
	if s.RunID != "" {
		if err := m.endRun(ctx, s); err != nil {
			m.setStopping(s.ID, false)
			return s, err
		}
	}
	return m.end(s, store.StateStopped, reason, eventSessionStopped), nil
}

// setStopping marks session id as being stopped, or no longer.
func (m *Manager) setStopping(id string, on bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.sandboxLocked(id).rt.stopping = on
}

// isStopping says whether a stop of session id is ending its run.
func (m *Manager) isStopping(id string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.runtimeLocked(id)
	return ok && r.stopping
}

// endRun asks the remote to end the run of session s.
func (m *Manager) endRun(ctx context.Context, s *store.Session) error {
	if c := m.sandboxIfAny(s.ID); c != nil {
		m.releaseNow(c)
	}
	if s.State == store.StateReady {
		if conn, err := m.sandboxOf(s).link.Get(ctx, target(s)); err == nil {
			if m.opts.HelperStop != nil {
				m.opts.HelperStop(ctx, conn)
			}
			if err := m.directive(ctx, conn, directiveEnd); err == nil {
				return nil
			}
		}
		// The agent is unreachable: cancelling through the API ends the
		// run all the same.
	}
	remote, err := m.remote(ctx)
	if err != nil {
		return err
	}
	if err := remote.CancelRun(ctx, s.RunID); err != nil && !definitelyOver(err) {
		return fmt.Errorf("cancel run %s: %w", s.RunID, err)
	}
	return nil
}

// stopQuietly ends a session from inside another operation, logging failures.
func (m *Manager) stopQuietly(s *store.Session, reason string) {
	ctx, cancel := context.WithTimeout(context.Background(), stopTimeout)
	defer cancel()
	if _, err := m.stopSession(ctx, s, reason); err != nil {
		m.log.Warn("stop session", "session", s.ID, "run", s.RunID, "err", err)
	}
}

package sessions

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// Prune ends and forgets the sessions whose checkout is gone (the directory
// or its .git was deleted) or whose run ended. A pass of reconcile first
// learns which runs ended at the remote; with DryRun nothing changes.
func (m *Manager) Prune(ctx context.Context, req ipc.PruneRequest) (ipc.PruneResponse, error) {
	resp := ipc.PruneResponse{DryRun: req.DryRun, Pruned: []ipc.PrunedSession{}}
	if _, err := m.ReconcileNow(ctx); err != nil {
		if ctx.Err() != nil {
			return resp, ctx.Err()
		}
		resp.Warnings = append(resp.Warnings, fmt.Sprintf("could not check with the remote (%v): runs it ended may be missed", err))
	}
	m.flushExecRecords()
	all, err := m.st.List()
	if err != nil {
		return resp, fmt.Errorf("list sessions to prune: %w", err)
	}
	for _, s := range all {
		why, detail := pruneReason(s)
		if why == "" {
			continue
		}
		p := ipc.PrunedSession{Session: m.info(s), Why: why, Detail: detail, Stopped: !s.State.Terminal()}
		if req.DryRun {
			resp.Pruned = append(resp.Pruned, p)
			continue
		}
		if !s.State.Terminal() {
			ended, err := m.stopSession(ctx, s, "pruned: "+detail)
			if err != nil {
				resp.Warnings = append(resp.Warnings, fmt.Sprintf("run %s kept: could not end it (%v); run `nook prune` again", s.RunID, err))
				continue
			}
			p.Session = m.info(ended)
		}
		if err := m.st.Delete(s.ID); err != nil && !errors.Is(err, store.ErrNotFound) {
			resp.Warnings = append(resp.Warnings, fmt.Sprintf("session %s: could not forget it (%v)", s.ID, err))
			continue
		}
		m.dropRuntime(s.ID)
		m.publish(eventSessionPruned, s, map[string]string{"why": why, "detail": detail})
		resp.Pruned = append(resp.Pruned, p)
	}
	return resp, nil
}

// pruneReason says why session s is to be pruned ("" when it is not).
func pruneReason(s *store.Session) (why, detail string) {
	if s.RepoRoot != "" {
		if _, err := os.Stat(filepath.Join(s.RepoRoot, ".git")); errors.Is(err, fs.ErrNotExist) {
			return ipc.PruneCheckoutGone, fmt.Sprintf("its checkout %s is gone", s.RepoRoot)
		}
	}
	if s.State.Terminal() {
		reason := s.StateReason
		if reason == "" {
			reason = string(s.State)
		}
		return ipc.PruneRunEnded, "its run ended (" + reason + ")"
	}
	return "", ""
}

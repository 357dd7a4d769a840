package sessions

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/sandboxd/sandboxd/daemon/gitsync"
	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// endPullTimeout bounds the pull before a stop or reset (or the listing
// of what --discard drops): past it the sandbox is not ended.
const endPullTimeout = 2 * time.Minute

// Pull brings the edits the caller's sandbox holds back into its checkout
// now, as an exec's pull does: an exec's that never came back, and those
// made outside an exec (ssh, scp, a background process, a shell without
// sync). Applied, or saved under .git/sandboxd/pulls and named.
func (m *Manager) Pull(ctx context.Context, req ipc.PullRequest) (ipc.PullResponse, error) {
	s, _, err := m.lookupBranch(ctx, req)
	if err != nil {
		return ipc.PullResponse{}, err
	}
	if s.State.Terminal() {
		return ipc.PullResponse{}, endedError(s)
	}
	if s.State != store.StateReady {
		return ipc.PullResponse{}, errdefs.Conflict(fmt.Errorf("sandbox %s is %s, not ready: nothing was synced to it yet", s.RunID, s.State))
	}
	defer m.hold(s.ID)()
	release, err := m.sandboxOf(s).line.Acquire(ctx, func(int) {})
	if err != nil {
		return ipc.PullResponse{}, errdefs.Canceled(fmt.Errorf("waiting for the sandbox: %w", err))
	}
	defer release()
	if s, err = m.st.Get(s.ID); err != nil {
		return ipc.PullResponse{}, err
	}
	e, err := m.pullBeforeStop(ctx, s)
	resp := ipc.PullResponse{RunID: s.RunID, Files: e.PulledFiles, SavedPatch: e.SavedPatch, Warnings: e.Warnings}
	if resp.Files == nil {
		resp.Files = []string{}
	}
	if err == nil {
		m.touch(s.ID)
	}
	return resp, err
}

// endEdits deals with session s's edits before it ends: pulled (applied,
// or saved and named), or with discard listed as dropped. An error means
// they could not be pulled: the caller must not end the sandbox.
func (m *Manager) endEdits(ctx context.Context, s *store.Session, discard bool) (ipc.EndEdits, error) {
	e := ipc.EndEdits{RunID: s.RunID}
	if s.State != store.StateReady || !hasCheckout(s) {
		return e, nil
	}
	ctx, cancel := context.WithTimeout(ctx, endPullTimeout)
	defer cancel()
	if !discard {
		// In the exec queue: an exec still running ends first (its edits
		// come back with it), and the pull never overlaps one.
		release, err := m.sandboxOf(s).line.Acquire(ctx, m.endWaitProgress(s))
		if err != nil {
			return e, errdefs.Conflict(fmt.Errorf("sandbox %s was not stopped: a command still runs in it after %s (%w); stop it again once the command is over, or with --discard to drop its edits", s.RunID, endPullTimeout, err))
		}
		defer release()
		e, err := m.pullBeforeStop(ctx, s)
		if err != nil {
			return e, errdefs.Conflict(fmt.Errorf("sandbox %s was not stopped: its edits could not be pulled first (%w); run `nook pull` to retry, or stop it with --discard to drop them", s.RunID, err))
		}
		return e, nil
	}
	conn, leaseDone, err := m.lockSandbox(ctx, s)
	if err != nil {
		e.Warnings = append(e.Warnings, fmt.Sprintf("could not list the edits the sandbox held (%v): they were discarded unseen", err))
		return e, nil
	}
	defer leaseDone()
	lc := &sshpool.Locked{Conn: conn, Relock: func(ctx context.Context) (*sshpool.Conn, error) { return m.relock(ctx, s) }}
	files, saved, err := m.opts.Sync.Unpulled(ctx, m.runner(lc), s.RepoRoot)
	switch {
	case saved != "":
		e.SavedPatch = saved
		e.Warnings = append(e.Warnings, "the sandbox's edits were too large to list; they are saved at "+saved+" rather than discarded")
	case errors.Is(err, gitsync.ErrNoSnapshot):
	case err != nil:
		e.Warnings = append(e.Warnings, fmt.Sprintf("could not list the edits the sandbox held (%v): they were discarded unseen", err))
	default:
		e.Discarded = files
	}
	return e, nil
}

// endWaitProgress says, as session.progress (nook stop and reset show
// it), that ending session s waits in its exec queue, for what and since
// when.
func (m *Manager) endWaitProgress(s *store.Session) func(ahead int) {
	since := m.now()
	return func(ahead int) {
		m.progress(s, ipc.PhaseWaiting, fmt.Sprintf("waiting for the command running in sandbox %s to end before pulling its edits (%d ahead in its queue) since %s", s.RunID, ahead, since.Local().Format("15:04:05")))
	}
}

// hasCheckout says session s's checkout is still there to take edits.
func hasCheckout(s *store.Session) bool {
	if s.RepoRoot == "" {
		return false
	}
	_, err := os.Stat(filepath.Join(s.RepoRoot, ".git"))
	return !errors.Is(err, fs.ErrNotExist)
}

// pullBeforeStop brings the sandbox's edits back into its checkout, as an
// exec's pull does (applied, or saved under .git/sandboxd/pulls and named
// in a warning). A checkout that is gone has nowhere to take them.
func (m *Manager) pullBeforeStop(ctx context.Context, s *store.Session) (ipc.EndEdits, error) {
	e := ipc.EndEdits{RunID: s.RunID}
	if !hasCheckout(s) {
		return e, nil
	}
	conn, leaseDone, err := m.lockSandbox(ctx, s)
	if err != nil {
		return e, err
	}
	defer leaseDone()
	lc := &sshpool.Locked{Conn: conn, Relock: func(ctx context.Context) (*sshpool.Conn, error) { return m.relock(ctx, s) }}
	m.mark(ctx, lc, directiveSyncStart)
	res, err := m.opts.Sync.Pull(ctx, m.runner(lc), s.RepoRoot)
	m.mark(ctx, lc, directiveSyncEnd)
	e.PulledFiles, e.SavedPatch, e.Warnings = res.Files, res.SavedPatch, res.Warnings
	var conflict *gitsync.ConflictError
	switch {
	case errors.As(err, &conflict):
		// Saved whole, and named: nothing is lost.
		e.SavedPatch = conflict.SavedPatch
		e.Warnings = append(e.Warnings, "the sandbox's edits conflict with your checkout: "+conflict.Error())
	case errors.Is(err, gitsync.ErrNoSnapshot):
		// Nothing was ever synced to this sandbox: there is no baseline
		// to pull against.
		m.log.Info("nothing was synced to the sandbox, nothing to pull", "run", s.RunID)
	case err != nil:
		return e, fmt.Errorf("pull the sandbox's edits: %w", err)
	}
	for _, w := range e.Warnings {
		m.log.Warn("pull", "run", s.RunID, "warning", w)
	}
	if len(e.PulledFiles) > 0 {
		m.log.Info("pulled the sandbox's edits", "run", s.RunID, "files", strings.Join(e.PulledFiles, ","))
	}
	return e, nil
}

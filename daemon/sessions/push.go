package sessions

import (
	"context"
	"fmt"

	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// Push syncs the caller's working tree (and unpushed commits) to its
// sandbox without running a command: the sandbox's turn, the agent lock,
// the push, as an exec does, and no pull. A sandbox is started (or adopted)
// when there is none.
func (m *Manager) Push(ctx context.Context, req ipc.PushRequest) (ipc.PushResponse, error) {
	var warnings []string
	s, p, err := m.sessionForExec(ctx, req, func(string) {}, func(w string) { warnings = append(warnings, w) })
	if err != nil {
		return ipc.PushResponse{}, err
	}
	defer m.hold(s.ID)()
	if req.RunID != "" {
		if p, err = m.idCheckout(req, s); err != nil {
			return ipc.PushResponse{}, err
		}
	}
	if p.RepoRoot == "" || p.RepoRoot != bindCheckout(s, p).RepoRoot {
		return ipc.PushResponse{}, errdefs.Invalidf("sandbox %s does not belong to a checkout here: run nook push inside the repository it was started from", s.RunID)
	}
	release, err := m.sandboxOf(s).line.Acquire(ctx, func(int) {})
	if err != nil {
		return ipc.PushResponse{}, errdefs.Canceled(fmt.Errorf("waiting for the sandbox: %w", err))
	}
	defer release()
	if s, err = m.st.Get(s.ID); err != nil {
		return ipc.PushResponse{}, err
	}
	if s.State.Terminal() {
		return ipc.PushResponse{}, endedError(s)
	}
	s = bindCheckout(s, p)
	conn, leaseDone, err := m.lockSandbox(ctx, s)
	if err != nil {
		return ipc.PushResponse{}, err
	}
	defer leaseDone()
	lc := &sshpool.Locked{Conn: conn, Relock: func(ctx context.Context) (*sshpool.Conn, error) { return m.relock(ctx, s) }}

	resp := ipc.PushResponse{RunID: s.RunID, RunURL: m.browserURL(s.RunURL), Files: []string{}, Warnings: warnings}
	warn := func(msg string) { resp.Warnings = append(resp.Warnings, msg) }
	m.mark(ctx, lc, directiveSyncStart)
	out, err := m.push(ctx, m.runner(lc), s, true, warn)
	m.mark(ctx, lc, directiveSyncEnd)
	resp.PulledFiles = out.recovered
	if err != nil {
		return resp, err
	}
	resp.Bytes, resp.Commits = out.result.Bytes, out.result.Commits
	if out.files != nil {
		resp.Files = out.files
	}
	m.publish(eventPushed, s, map[string]any{"files": len(resp.Files), "commits": resp.Commits})
	return resp, nil
}

package sessions

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// branchPlace resolves a request that names no config and no run the way
// the RWX CLI's exec, stop, reset and status do: the branch's one live
// sandbox, whatever config started it; several are a choice the caller must
// make (the error lists them). It returns the place of that sandbox (its
// config) and ok, or ok false when the request names a config or a run, or
// when the branch has no live sandbox: the default config
// (.rwx/sandbox.yml) then applies, as it does for creating one.
func (m *Manager) branchPlace(t ipc.Target) (place, bool, error) {
	if t.RunID != "" || t.ConfigFile != "" {
		return place{}, false, nil
	}
	p, err := m.locate(t)
	if err != nil {
		return p, false, err
	}
	all, err := m.st.LiveOnBranch(p.RepoRoot, p.Branch)
	if err != nil {
		return p, false, err
	}
	var live []*store.Session
	for _, s := range all {
		if s.State.Terminal() || s.RepoRoot != p.RepoRoot || s.Branch != p.Branch || strings.HasPrefix(s.ConfigFile, "run:") {
			continue
		}
		live = append(live, s)
	}
	switch len(live) {
	case 0:
		return p, false, nil
	case 1:
		p.ConfigFile = live[0].ConfigFile
		return p, true, nil
	}
	var b strings.Builder
	rels := make([]string, len(live))
	for i, s := range live {
		rels[i] = s.ConfigFile
		if rel, err := filepath.Rel(p.RepoRoot, s.ConfigFile); err == nil {
			rels[i] = rel
		}
		fmt.Fprintf(&b, "\n  %s  run %s (%s)", rels[i], s.RunID, s.State)
	}
	return p, false, errdefs.Conflictf("branch %s of %s has %d live sandboxes:%s\nname one: give its config (for example `nook exec %s -- CMD`) or --id RUN",
		p.Branch, p.RepoRoot, len(live), b.String(), rels[0])
}

// lookupBranch is lookup with a config-less request resolved to the
// branch's live sandbox (branchPlace).
func (m *Manager) lookupBranch(ctx context.Context, t ipc.Target) (*store.Session, place, error) {
	if t.RunID != "" || t.ConfigFile != "" {
		return m.lookup(ctx, t)
	}
	p, _, err := m.branchPlace(t)
	if err != nil {
		return nil, p, withIDHint(err)
	}
	return m.lookupIn(ctx, p)
}

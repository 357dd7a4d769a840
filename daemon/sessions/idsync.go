package sessions

import (
	"path/filepath"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// idCheckout is, for a request that names its run (--id), the caller's
// checkout: the RWX CLI syncs the working directory's checkout into the run
// it is given, and so does sandboxd. A caller outside any repository syncs
// nothing. A run that is the sandbox of another checkout is refused rather
// than fed a second tree (its pending edits belong to the other one).
func (m *Manager) idCheckout(t ipc.Target, s *store.Session) (place, error) {
	if t.RunID == "" || t.Cwd == "" || !filepath.IsAbs(t.Cwd) {
		return place{}, nil
	}
	cwd := filepath.Clean(t.Cwd)
	if real, err := filepath.EvalSymlinks(cwd); err == nil {
		cwd = real
	}
	root, err := findRepoRoot(cwd)
	if err != nil {
		return place{}, nil
	}
	if s.RepoRoot != "" && s.RepoRoot != root {
		return place{}, errdefs.Conflictf("run %s is the sandbox of %s, not of %s: run the command there, or pass --no-sync to run it without your changes", s.RunID, s.RepoRoot, root)
	}
	return place{cwd: cwd, Identity: store.Identity{RepoRoot: root}}, nil
}

// bindCheckout is session s synced from checkout p: a run attached outside
// any checkout (no repository of its own) takes the caller's, for this
// request only.
func bindCheckout(s *store.Session, p place) *store.Session {
	if s == nil || s.RepoRoot != "" || p.RepoRoot == "" {
		return s
	}
	c := *s
	c.RepoRoot = p.RepoRoot
	return &c
}

// bgCheckout is idCheckout for a background process that syncs first.
func (m *Manager) bgCheckout(t ipc.Target, s *store.Session, p place, sync bool) (*store.Session, place, error) {
	if t.RunID == "" || !sync {
		return s, p, nil
	}
	p, err := m.idCheckout(t, s)
	if err != nil {
		return s, p, err
	}
	return bindCheckout(s, p), p, nil
}

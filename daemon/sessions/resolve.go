package sessions

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/sandboxd/sandboxd/rwxapi"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// place is where a request comes from: the caller's repository, branch and
// config file, i.e. the identity of the session it means.
type place struct {
	cwd string
	store.Identity
}

// configRel is the config path relative to the repository root (stamped in
// cli_state as sandboxd's configRel; older RWX CLIs wrote this relative form
// as configFile).
func (p place) configRel() string {
	rel, err := filepath.Rel(p.RepoRoot, p.ConfigFile)
	if err != nil {
		return p.ConfigFile
	}
	return filepath.ToSlash(rel)
}

// locate turns a request's cwd and config into an identity using file-system
// reads and the branch cache only.
func (m *Manager) locate(t ipc.Target) (place, error) {
	if t.Cwd == "" {
		return place{}, errdefs.Invalidf("cwd is required: send the caller's absolute working directory")
	}
	if !filepath.IsAbs(t.Cwd) {
		return place{}, errdefs.Invalidf("cwd %q is not an absolute path", t.Cwd)
	}
	cwd := filepath.Clean(t.Cwd)
	if st, err := os.Stat(cwd); err != nil {
		return place{}, errdefs.Invalidf("cwd %s does not exist: %v", cwd, err)
	} else if !st.IsDir() {
		return place{}, errdefs.Invalidf("cwd %s is not a directory", cwd)
	}
	// Resolve symlinks so /tmp and /private/tmp style aliases (and symlinked
	// checkouts) find the same session.
	if real, err := filepath.EvalSymlinks(cwd); err == nil {
		cwd = real
	}
	root, err := findRepoRoot(cwd)
	if err != nil {
		return place{}, err
	}
	cfg, err := findConfig(cwd, root, t.ConfigFile)
	if err != nil {
		return place{}, err
	}
	branch, err := m.opts.Branches.Branch(root)
	if err != nil {
		return place{}, fmt.Errorf("read the current branch of %s: %w", root, err)
	}
	m.watchCLIFile(root)
	return place{cwd: cwd, Identity: store.Identity{RepoRoot: root, Branch: branch, ConfigFile: cfg}}, nil
}

// lookup finds the session a request means without creating one and
// without calling the remote: by run id, else by identity (adopting a
// detached session whose commit is an ancestor of HEAD, or a legacy RWX CLI
// record). It returns errdefs.ErrNotFound when there is none; create then
// looks for a matching run on the remote.
func (m *Manager) lookup(ctx context.Context, t ipc.Target) (*store.Session, place, error) {
	if t.RunID != "" {
		s, err := m.st.ByRunID(t.RunID)
		if err == nil {
			return s, place{}, nil
		}
		if !errors.Is(err, store.ErrNotFound) {
			return nil, place{}, err
		}
		return nil, place{}, errdefs.NotFoundf("no session for run %s: attach to it with `nook start --id %s`", t.RunID, t.RunID)
	}
	p, err := m.locate(t)
	if err != nil {
		return nil, p, withIDHint(err) // start, exec, status and stop take --id
	}
	return m.lookupIn(ctx, p)
}

// lookupIn is lookup at a located place.
func (m *Manager) lookupIn(ctx context.Context, p place) (*store.Session, place, error) {
	s, err := m.st.ByIdentity(p.Identity)
	if err == nil {
		return s, p, nil
	}
	if !errors.Is(err, store.ErrNotFound) {
		return nil, p, err
	}
	if s, err := m.adoptLocal(ctx, p); err != nil || s != nil {
		return s, p, err
	}
	return nil, p, errdefs.NotFoundf("no sandbox for %s (branch %s, config %s): start one with `nook start`", p.RepoRoot, p.Branch, p.configRel())
}

// adoptLocal handles the local, API-free adoption paths: a detached-HEAD
// session whose commit is an ancestor of HEAD, and a legacy sandboxes.json.
func (m *Manager) adoptLocal(ctx context.Context, p place) (*store.Session, error) {
	if _, err := m.readCLIFile(ctx, p.RepoRoot); err != nil {
		m.log.Warn("read the RWX CLI's sandboxes file", "repo", p.RepoRoot, "err", err)
	} else if s, err := m.st.ByIdentity(p.Identity); err == nil {
		return s, nil
	}
	if !strings.HasPrefix(p.Branch, detachedPrefix) {
		return nil, nil
	}
	all, err := m.st.List()
	if err != nil {
		return nil, err
	}
	for _, s := range all {
		if s.State.Terminal() || s.RepoRoot != p.RepoRoot || s.ConfigFile != p.ConfigFile || !strings.HasPrefix(s.Branch, detachedPrefix) {
			continue
		}
		sha := strings.TrimPrefix(s.Branch, detachedPrefix)
		if !m.git.isAncestor(ctx, p.RepoRoot, sha, "HEAD") {
			continue
		}
		updated, err := m.st.Update(s.ID, func(s *store.Session) error {
			s.Branch = p.Branch
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("adopt detached session %s: %w", s.ID, err)
		}
		m.publish(eventSessionAdopted, updated, map[string]string{"from": s.Branch, "to": p.Branch})
		m.cliFileChanged(p.RepoRoot)
		return updated, nil
	}
	return nil, nil
}

const detachedPrefix = "detached@"

// adoptRemote looks for a run on the remote whose cli_state names this
// identity (a run started by another machine's sandboxd, by the RWX CLI, or a
// session whose local record was lost) and adopts it.
func (m *Manager) adoptRemote(ctx context.Context, p place) (*store.Session, error) {
	remote, err := m.remote(ctx)
	if err != nil {
		return nil, err
	}
	runs, err := remote.ListSandboxes(ctx)
	if err != nil {
		// Adoption is an optimisation of create; a failing list must not
		// block the caller, the create below is idempotent anyway.
		m.log.Warn("list sandboxes for adoption failed", "err", err)
		return nil, nil
	}
	for _, run := range runs {
		if !m.matches(run, p) {
			continue
		}
		return m.adopt(ctx, run, p.Identity)
	}
	return nil, nil
}

// matches reports whether a remote run belongs to place p, from any form
// of cli_state: sandboxd's (configRel and repoRoot), today's RWX CLI's (an
// absolute configFile) and older ones' (a configFile relative to the
// repository).
func (m *Manager) matches(run rwxapi.RunSummary, p place) bool {
	if run.CLIState == "" {
		return false
	}
	cs, err := rwxapi.DecodeCLIState(run.CLIState)
	if err != nil {
		return false
	}
	if cs.Branch != p.Branch {
		return false
	}
	if cs.RepoRoot != "" && canonical(cs.RepoRoot) != p.RepoRoot {
		return false
	}
	switch {
	case cs.ConfigRel != "":
		return filepath.Clean(filepath.FromSlash(cs.ConfigRel)) == filepath.FromSlash(p.configRel())
	case filepath.IsAbs(cs.ConfigFile):
		return canonical(cs.ConfigFile) == p.ConfigFile
	case cs.ConfigFile != "":
		return filepath.Clean(filepath.FromSlash(cs.ConfigFile)) == filepath.FromSlash(p.configRel())
	default:
		return p.configRel() == DefaultConfigRel
	}
}

// canonical is path with symlinks resolved as far as it exists (the form
// identities use), so that the RWX CLI's spelling of a checkout (it takes
// the shell's working directory) matches sandboxd's.
func canonical(path string) string {
	path = filepath.Clean(path)
	if real, err := filepath.EvalSymlinks(path); err == nil {
		return real
	}
	if real, err := filepath.EvalSymlinks(filepath.Dir(path)); err == nil {
		return filepath.Join(real, filepath.Base(path))
	}
	return path
}

// adopt records a remote run as the session of identity id (never
// overwriting an existing one: if the identity was taken meanwhile, that
// session wins).
func (m *Manager) adopt(ctx context.Context, run rwxapi.RunSummary, id store.Identity) (*store.Session, error) {
	s := &store.Session{
		Identity:       id,
		Remote:         m.opts.Remotes.Info().Name,
		RunID:          run.ID,
		RunURL:         run.RunURL,
		IdempotencyKey: newIdempotencyKey(),
		State:          store.StateUnknown,
		Adopted:        true,
		ConfigHash:     hashFile(id.RepoRoot, id.ConfigFile),
	}
	if err := m.st.Insert(s); err != nil {
		var exists *store.ExistsError
		if errors.As(err, &exists) {
			return exists.Existing, nil
		}
		return nil, fmt.Errorf("adopt run %s: %w", run.ID, err)
	}
	m.publish(eventSessionAdopted, s, map[string]string{"runUrl": m.browserURL(run.RunURL)})
	m.cliFileChanged(id.RepoRoot)
	return s, nil
}

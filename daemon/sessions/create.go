package sessions

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"sort"
	"time"

	"github.com/sandboxd/sandboxd/rwxapi"

	"github.com/sandboxd/sandboxd/daemon/repofile"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// Start creates the session's run, or reports the active one.
func (m *Manager) Start(ctx context.Context, req ipc.StartRequest) (ipc.StartResponse, error) {
	if req.RunID != "" {
		return m.attach(ctx, req)
	}
	s, p, err := m.lookup(ctx, req.Target)
	created := false
	switch {
	case err == nil && s.RunID != "":
	case err == nil || errors.Is(err, errdefs.ErrNotFound) && p.RepoRoot != "":
		s, err = m.create(ctx, p, req.Init)
		if err != nil {
			return ipc.StartResponse{}, err
		}
		created = true
	default:
		return ipc.StartResponse{}, err
	}
	if req.Wait {
		if s, err = m.waitReady(ctx, s, waitTimeout(req)); err != nil {
			return ipc.StartResponse{Session: m.info(s)}, err
		}
	}
	return ipc.StartResponse{Session: m.info(s), Created: created}, nil
}

func waitTimeout(req ipc.StartRequest) time.Duration {
	if req.WaitTimeoutSeconds > 0 {
		return time.Duration(req.WaitTimeoutSeconds) * time.Second
	}
	return 0
}

// Reset stops the identity's active run (cancelling it if it is still
// provisioning) and starts a new one, as one step for concurrent callers.
func (m *Manager) Reset(ctx context.Context, req ipc.StartRequest) (ipc.StartResponse, error) {
	if req.RunID != "" {
		return ipc.StartResponse{}, errdefs.Invalidf("reset works on the session of a checkout: run it from the repository instead of passing --id")
	}
	p, err := m.locate(req.Target)
	if err != nil {
		return ipc.StartResponse{}, err
	}
	if bp, ok, err := m.branchPlace(req.Target); err != nil {
		return ipc.StartResponse{}, err
	} else if ok {
		p = bp // the branch's live sandbox, whatever its config
	}
	var replaced string
	var edits *ipc.EndEdits
	// The old sandbox's edits come back first (or, with Discard, are
	// listed as dropped); when they cannot, it is not replaced.
	if old, err := m.st.ByIdentity(p.Identity); err == nil && !old.State.Terminal() {
		e, err := m.endEdits(ctx, old, req.Discard)
		if err != nil {
			return ipc.StartResponse{}, err
		}
		edits = &e
	}
	s, err := m.creates.do(ctx, p.Key(), m.opts.CreateTimeout, func(ctx context.Context) (*store.Session, error) {
		// Under the RWX CLI's lock, as `rwx sandbox reset` runs: a CLI exec
		// meanwhile waits and then finds the new run.
		unlock := m.lockCLIFileFor(ctx, p)
		defer unlock()
		if old, err := m.st.ByIdentity(p.Identity); err == nil {
			replaced = old.RunID
			if _, err := m.stopSession(ctx, old, "reset"); err != nil {
				return nil, fmt.Errorf("stop the old sandbox %s: %w", old.RunID, err)
			}
		} else if !errors.Is(err, store.ErrNotFound) {
			return nil, err
		}
		s, err := m.createLocked(ctx, p, req.Init, nil)
		if err == nil {
			if werr := m.writeCLIFile(ctx, p.RepoRoot, true); werr != nil {
				m.log.Warn("update the RWX CLI's sandboxes file", "repo", p.RepoRoot, "err", werr)
			}
		}
		return s, err
	})
	if err != nil {
		return ipc.StartResponse{}, err
	}
	if req.Wait {
		if s, err = m.waitReady(ctx, s, waitTimeout(req)); err != nil {
			return ipc.StartResponse{Session: m.info(s), Replaced: replaced, Edits: edits}, err
		}
	}
	return ipc.StartResponse{Session: m.info(s), Created: true, Replaced: replaced, Edits: edits}, nil
}

// attach makes an existing run the session of the caller (nook start --id).
func (m *Manager) attach(ctx context.Context, req ipc.StartRequest) (ipc.StartResponse, error) {
	if s, err := m.st.ByRunID(req.RunID); err == nil && !s.State.Terminal() {
		if req.Wait {
			s, err = m.waitReady(ctx, s, waitTimeout(req))
			return ipc.StartResponse{Session: m.info(s)}, err
		}
		return ipc.StartResponse{Session: m.info(s)}, nil
	}
	remote, err := m.remote(ctx)
	if err != nil {
		return ipc.StartResponse{}, err
	}
	ci, err := remote.ConnectionInfo(ctx, req.RunID, "")
	if err != nil {
		return ipc.StartResponse{}, fmt.Errorf("look up run %s: %w", req.RunID, err)
	}
	if ci.Polling.Completed {
		return ipc.StartResponse{}, errdefs.Gone(fmt.Errorf("run %s is no longer active: start a new sandbox with `nook start`", req.RunID))
	}
	id := store.Identity{ConfigFile: "run:" + req.RunID}
	if req.Cwd != "" {
		if p, err := m.locate(req.Target); err == nil {
			id = p.Identity
			if _, err := m.st.ByIdentity(id); err == nil {
				// The checkout already has a session: attach the run beside it.
				id.ConfigFile = "run:" + req.RunID
				id.Branch = ""
			}
		}
	}
	s, err := m.adopt(ctx, rwxapi.RunSummary{ID: req.RunID}, id)
	if err != nil {
		return ipc.StartResponse{}, err
	}
	if tok, err := remote.CreateSandboxToken(ctx, req.RunID, m.opts.TokenTTL); err == nil {
		s, _ = m.st.Update(s.ID, func(s *store.Session) error { s.Token = tok.Token; return nil })
	}
	if req.Wait || ci.Sandboxable {
		if s, err = m.waitReady(ctx, s, waitTimeout(req)); err != nil {
			return ipc.StartResponse{Session: m.info(s)}, err
		}
	}
	return ipc.StartResponse{Session: m.info(s), Created: false}, nil
}

// create adopts or creates the session of place p once, however many
// callers ask at the same time: they all join the one call in flight, so a
// burst of callers costs one list call and at most one create.
func (m *Manager) create(ctx context.Context, p place, init map[string]string) (*store.Session, error) {
	return m.creates.do(ctx, p.Key(), m.opts.CreateTimeout, func(ctx context.Context) (*store.Session, error) {
		existing, err := m.st.ByIdentity(p.Identity)
		switch {
		case err == nil && existing.RunID != "":
			return existing, nil
		case err == nil:
			// A create that did not finish (timeout, crash): resume it with
			// its idempotency key.
			return m.createLocked(ctx, p, init, existing)
		case !errors.Is(err, store.ErrNotFound):
			return nil, err
		}
		// Under the RWX CLI's lock, as a CLI process resolves and creates:
		// a CLI that started this identity's sandbox meanwhile has recorded
		// it by the time the lock is ours, and one that comes after finds
		// sandboxd's record.
		unlock := m.lockCLIFileFor(ctx, p)
		defer unlock()
		if _, err := m.readCLIFile(ctx, p.RepoRoot); err != nil {
			m.log.Warn("read the RWX CLI's sandboxes file", "repo", p.RepoRoot, "err", err)
		} else if s, err := m.st.ByIdentity(p.Identity); err == nil && s.RunID != "" {
			return s, nil
		}
		// A run on the remote may already be this identity's (its local
		// record was lost, or another client started it).
		s, err := m.adoptRemote(ctx, p)
		if err == nil && s == nil {
			s, err = m.createLocked(ctx, p, init, nil)
		}
		if err == nil {
			if werr := m.writeCLIFile(ctx, p.RepoRoot, true); werr != nil {
				m.log.Warn("update the RWX CLI's sandboxes file", "repo", p.RepoRoot, "err", werr)
			}
		}
		return s, err
	})
}

// createLocked creates a run for place p, or resumes the unfinished create of
// record s. The caller holds the identity's create flight.
func (m *Manager) createLocked(ctx context.Context, p place, init map[string]string, s *store.Session) (*store.Session, error) {
	def, baseSHA, origin, err := m.runDefinition(ctx, p, init)
	if err != nil {
		return nil, err
	}
	remote, err := m.remote(ctx)
	if err != nil {
		return nil, err
	}
	if s == nil {
		// The record exists before the API call, with the idempotency key
		// that any retry of this create sends: a crash or a timeout after
		// the remote created the run finds the same run instead of a second.
		s = &store.Session{
			Identity:       p.Identity,
			Remote:         m.opts.Remotes.Info().Name,
			IdempotencyKey: newIdempotencyKey(),
			ConfigHash:     hashFile(p.RepoRoot, p.ConfigFile),
			BaseSHA:        baseSHA,
			OriginURL:      origin,
			State:          store.StateCreating,
		}
		if err := m.st.Insert(s); err != nil {
			var exists *store.ExistsError
			if errors.As(err, &exists) {
				return exists.Existing, nil
			}
			return nil, fmt.Errorf("record the new session: %w", err)
		}
	}
	m.progress(s, ipc.PhaseCreating, "")
	res, err := remote.CreateRun(ctx, def, s.IdempotencyKey)
	if err != nil {
		if errdefs.KindOf(err) != errdefs.KindUnavailable {
			// A definite refusal: end the record so it does not block the
			// identity. A transient failure keeps it, and the next attempt
			// re-sends the same key.
			reason := fmt.Sprintf("create failed: %v", err)
			if _, uerr := m.st.Update(s.ID, func(s *store.Session) error {
				s.State, s.StateReason = store.StateFailed, reason
				return nil
			}); uerr != nil {
				m.log.Warn("record failed create", "session", s.ID, "err", uerr)
			}
		}
		return nil, remoteCallFailed("create the sandbox run", err)
	}
	s, err = m.st.Update(s.ID, func(s *store.Session) error {
		s.RunID, s.RunURL, s.State = res.RunID, res.RunURL, store.StateProvisioning
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("record run %s: %w", res.RunID, err)
	}
	m.publish(eventSessionCreated, s, map[string]string{"runUrl": m.browserURL(s.RunURL), "branch": s.Branch})
	m.progress(s, ipc.PhaseCreated, "")
	m.watchConfig(s)
	m.cliFileChanged(s.RepoRoot)
	tok, err := remote.CreateSandboxToken(ctx, s.RunID, m.opts.TokenTTL)
	if err != nil {
		// The account token still works; a scoped token is an optimisation.
		m.log.Warn("create scoped token failed", "run", s.RunID, "err", err)
		return s, nil
	}
	exp, _ := time.Parse(time.RFC3339, tok.ExpiresAt)
	return m.st.Update(s.ID, func(s *store.Session) error {
		s.Token, s.TokenExpiresAt = tok.Token, exp
		return nil
	})
}

// runDefinition builds the create-run request of place p.
func (m *Manager) runDefinition(ctx context.Context, p place, init map[string]string) (rwxapi.RunDefinition, string, string, error) {
	var def rwxapi.RunDefinition
	cfgBytes, err := repofile.ReadFile(ctx, p.RepoRoot, p.ConfigFile, repofile.MaxFileBytes)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return def, "", "", errdefs.Invalidf("no sandbox config at %s: create one with `nook init`", p.ConfigFile)
		}
		return def, "", "", fmt.Errorf("read the sandbox config: %w", err)
	}
	head, err := m.git.head(ctx, p.RepoRoot)
	if err != nil {
		return def, "", "", err
	}
	origin := m.git.origin(ctx, p.RepoRoot)
	var sha, cloneURL string
	if m.opts.Remotes.Info().Name == "local" {
		// A local sandbox clones this very repository: every local commit
		// is reachable, and nothing is fetched from the network.
		sha, cloneURL = head, p.RepoRoot
	} else {
		if origin == "" {
			return def, "", "", errdefs.Invalidf("the repository %s has no `origin` remote: a cloud sandbox clones from origin; add one (git remote add origin URL) and push", p.RepoRoot)
		}
		if sha, err = m.git.pushedBase(ctx, p.RepoRoot); err != nil {
			return def, "", "", err
		}
		cloneURL = origin
	}
	branch := p.Branch
	if len(branch) > len(detachedPrefix) && branch[:len(detachedPrefix)] == detachedPrefix {
		branch = ""
	}
	rwxDir, err := readRwxDirectory(ctx, p.RepoRoot, filepath.Dir(p.ConfigFile))
	if err != nil {
		return def, "", "", err
	}
	def = rwxapi.RunDefinition{
		Title: title(p),
		// What the RWX CLI writes (an absolute configFile: it panics on a
		// relative one) plus sandboxd's own fields.
		CLIState: rwxapi.CLIState{
			Branch: p.Branch, ConfigFile: p.ConfigFile, RepoRoot: p.RepoRoot, OriginURL: origin, ConfigRel: p.configRel(),
		}.Encode(),
		Git:             rwxapi.GitMetadata{Branch: branch, Sha: sha, OriginURL: cloneURL},
		TaskDefinitions: []rwxapi.DirectoryEntry{{Path: p.configRel(), Type: "file", Permissions: 0o644, FileContents: string(cfgBytes)}},
		MintDirectory:   rwxDir,
		UseCache:        true,
	}
	keys := make([]string, 0, len(init))
	for k := range init {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		def.InitializationParameters = append(def.InitializationParameters, rwxapi.InitParameter{Key: k, Value: init[k]})
	}
	return def, sha, origin, nil
}

// readRwxDirectory lists the config's directory (normally .rwx) as run
// directory entries, skipping the RWX CLI's own sandbox bookkeeping. Only
// regular files inside the repository are read, within repofile's limits.
func readRwxDirectory(ctx context.Context, repoRoot, dir string) ([]rwxapi.DirectoryEntry, error) {
	files, err := repofile.ReadDir(ctx, repoRoot, dir, "sandboxes")
	if err != nil {
		return nil, fmt.Errorf("read the config directory: %w", err)
	}
	entries := make([]rwxapi.DirectoryEntry, 0, len(files))
	for _, f := range files {
		e := rwxapi.DirectoryEntry{Path: f.Path, Permissions: uint32(f.Perm), Type: "file", FileContents: string(f.Data)}
		if f.Dir {
			e.Type = "dir"
		}
		entries = append(entries, e)
	}
	return entries, nil
}

func title(p place) string {
	b := p.Branch
	if len(b) > len(detachedPrefix) && b[:len(detachedPrefix)] == detachedPrefix {
		b = "detached " + b[len(detachedPrefix):]
	}
	t := fmt.Sprintf("Sandbox: %s (%s)", filepath.Base(p.RepoRoot), b)
	if rel := p.configRel(); rel != DefaultConfigRel {
		t += " [" + rel + "]"
	}
	return t
}

func newIdempotencyKey() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b) // crypto/rand never fails on Linux
	return "sandboxd-" + hex.EncodeToString(b)
}

// hashFile is the config hash used for drift detection ("" when
// unreadable, outside the repository or too large).
func hashFile(repoRoot, path string) string {
	if repoRoot == "" {
		return ""
	}
	b, err := repofile.ReadFile(context.Background(), repoRoot, path, repofile.MaxFileBytes)
	if err != nil {
		return ""
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

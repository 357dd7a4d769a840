package sessions

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/rwxapi"

	"github.com/sandboxd/sandboxd/daemon/gitsync"
	"github.com/sandboxd/sandboxd/daemon/runsapi"
	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// Probe outcomes.
const (
	ProbeConnected = "connected"
	ProbeExpired   = "expired"
	ProbeNoSandbox = "no_sandbox"
	ProbeUnknown   = "unknown"
)

// ReconcileReport counts what one reconcile pass did.
type ReconcileReport struct {
	Listed   int `json:"listed"`
	Adopted  int `json:"adopted"`
	Checked  int `json:"checked"`
	Expired  int `json:"expired"`
	Unknown  int `json:"unknown"`
	Pruned   int `json:"pruned"`
	Sessions int `json:"sessions"`
}

// reconcileTimeout bounds one pass.
const reconcileTimeout = 2 * time.Minute

// checkParallelism bounds concurrent per-run checks.
const checkParallelism = 8

// Reconcile runs a reconcile pass, or joins the one in flight.
func (m *Manager) Reconcile(ctx context.Context) error {
	_, err := m.ReconcileNow(ctx)
	return err
}

// ReconcileNow runs a reconcile pass, or joins the one in flight, and returns
// its report. Only one pass runs at a time.
func (m *Manager) ReconcileNow(ctx context.Context) (ReconcileReport, error) {
	return m.reconciles.do(ctx, "reconcile", reconcileTimeout, m.reconcile)
}

// reconcile makes the store agree with the remote: one bulk list call,
// adoption of remote runs stamped by sandboxd, one check per local session
// the list does not show; only definite answers prune.
func (m *Manager) reconcile(ctx context.Context) (ReconcileReport, error) {
	var rep ReconcileReport
	defer func() {
		m.opts.Events.Publish(eventReconciled, "", "", rep)
	}()
	m.mu.Lock()
	retention := m.daemonCfg.HistoryRetention
	m.mu.Unlock()
	if retention > 0 {
		n, err := m.st.PruneHistory(m.now().Add(-retention))
		if err != nil {
			m.log.Warn("prune session history", "err", err)
		}
		rep.Pruned = n
	}
	remote, err := m.remote(ctx)
	if err != nil {
		return rep, err
	}
	runs, err := remote.ListSandboxes(ctx)
	if err != nil {
		return rep, remoteCallFailed("list sandboxes on the remote", err)
	}
	rep.Listed = len(runs)
	listed := make(map[string]bool, len(runs))
	for _, run := range runs {
		listed[run.ID] = true
		if s, err := m.st.ByRunID(run.ID); err == nil {
			m.refreshRunURL(s, run.RunURL)
			continue
		}
		if id, ok := m.identityOf(run); ok {
			if s, err := m.adopt(ctx, run, id); err == nil && s.RunID == run.ID {
				rep.Adopted++
			}
		}
	}
	all, err := m.st.List()
	if err != nil {
		return rep, err
	}
	var toCheck []*store.Session
	for _, s := range all {
		if s.State.Terminal() || s.RunID == "" {
			continue
		}
		rep.Sessions++
		if listed[s.RunID] && s.State == store.StateReady {
			continue
		}
		// Missing from the list (over, or still initializing) or not yet
		// known to be ready: one check of its own before anything is pruned.
		toCheck = append(toCheck, s)
	}
	var mu sync.Mutex
	m.forEach(ctx, toCheck, func(s *store.Session) {
		outcome := m.check(ctx, s)
		mu.Lock()
		defer mu.Unlock()
		rep.Checked++
		switch outcome {
		case ProbeExpired:
			rep.Expired++
		case ProbeUnknown:
			rep.Unknown++
		}
	})
	return rep, nil
}

// refreshRunURL records a run's URL as the remote gives it now: the local
// remote's URL carries its port, which changes when it restarts.
func (m *Manager) refreshRunURL(s *store.Session, url string) {
	if url == "" || url == s.RunURL || s.State.Terminal() {
		return
	}
	if _, err := m.st.Update(s.ID, func(s *store.Session) error { s.RunURL = url; return nil }); err != nil {
		m.log.Warn("record the run's new URL", "run", s.RunID, "err", err)
	}
}

// identityOf is the identity a remote run claims through its cli_state, when
// that names a checkout on this machine: sandboxd stamps its repository root;
// today's RWX CLI an absolute config file, whose checkout is found from it.
// Older relative states name no checkout: those runs are adopted when a
// caller in their repository asks (adoptRemote).
func (m *Manager) identityOf(run rwxapi.RunSummary) (store.Identity, bool) {
	if run.CLIState == "" {
		return store.Identity{}, false
	}
	cs, err := rwxapi.DecodeCLIState(run.CLIState)
	if err != nil || cs.Branch == "" {
		return store.Identity{}, false
	}
	if cs.RepoRoot == "" {
		if !filepath.IsAbs(cs.ConfigFile) {
			return store.Identity{}, false
		}
		cfg := canonical(cs.ConfigFile)
		if _, err := os.Stat(cfg); err != nil {
			return store.Identity{}, false // not a checkout of this machine (any more)
		}
		root, err := findRepoRoot(filepath.Dir(cfg))
		if err != nil {
			return store.Identity{}, false
		}
		return store.Identity{RepoRoot: root, Branch: cs.Branch, ConfigFile: cfg}, true
	}
	if !filepath.IsAbs(cs.RepoRoot) {
		return store.Identity{}, false
	}
	rel := cs.ConfigRel
	if rel == "" {
		rel = cs.ConfigFile
	}
	if rel == "" {
		rel = DefaultConfigRel
	}
	cfg := filepath.FromSlash(rel)
	if !filepath.IsAbs(cfg) {
		cfg = filepath.Join(cs.RepoRoot, cfg)
	}
	return store.Identity{RepoRoot: cs.RepoRoot, Branch: cs.Branch, ConfigFile: filepath.Clean(cfg)}, true
}

// forEach runs fn over sessions with bounded parallelism.
func (m *Manager) forEach(ctx context.Context, ss []*store.Session, fn func(*store.Session)) {
	sem := make(chan struct{}, checkParallelism)
	var wg sync.WaitGroup
	for _, s := range ss {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			wg.Wait()
			return
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			fn(s)
		}()
	}
	wg.Wait()
}

// check asks the remote about one session and records the answer: ready
// (and reconnecting), provisioning, expired on a definite answer, unknown on
// a transient one (kept, retried later).
func (m *Manager) check(ctx context.Context, s *store.Session) string {
	remote, err := m.remote(ctx)
	if err != nil {
		m.markUnknown(s, err)
		return ProbeUnknown
	}
	ci, err := m.connectionInfo(ctx, remote, s)
	switch {
	case err != nil && definitelyOver(err):
		m.expire(s, remoteReason(err))
		return ProbeExpired
	case err != nil:
		m.markUnknown(s, err)
		return ProbeUnknown
	case ci.Polling.Completed && !ci.Sandboxable: // RWX marks a ready sandbox completed too
		m.expire(s, "the run is over")
		return ProbeExpired
	case ci.Sandboxable:
		if _, err := m.markReady(s, ci); err != nil {
			m.log.Warn("record ready session", "session", s.ID, "err", err)
			return ProbeUnknown
		}
		return ProbeConnected
	default:
		if s.State != store.StateProvisioning {
			if _, err := m.st.Update(s.ID, func(s *store.Session) error {
				s.State, s.StateReason = store.StateProvisioning, ""
				return nil
			}); err != nil {
				m.log.Warn("record provisioning session", "session", s.ID, "err", err)
			}
		}
		return ProbeNoSandbox
	}
}

// markUnknown records a transient failure to learn a session's state.
func (m *Manager) markUnknown(s *store.Session, cause error) {
	m.log.Info("session state unknown for now", "session", s.ID, "run", s.RunID, "err", cause)
	if _, err := m.st.Update(s.ID, func(s *store.Session) error {
		if !s.State.Terminal() {
			s.State, s.StateReason = store.StateUnknown, cause.Error()
		}
		return nil
	}); err != nil {
		m.log.Warn("record unknown session", "session", s.ID, "err", err)
	}
}

// Rehydrate re-learns the runtime facts of every stored live session in the
// background: identity (run id, keys, token) is trusted, connection and
// deadlines are asked of the remote. Requests for a session wait for its own
// check only. It returns at once, once the sessions' port forwards are open
// again: they are reopened before the background work starts, which with a
// thousand sessions would compete with the daemon's start for the CPU and
// delay READY (docs/performance.md).
func (m *Manager) Rehydrate(ctx context.Context) {
	all, err := m.st.List()
	if err != nil {
		m.log.Error("rehydrate: list sessions", "err", err)
		return
	}
	var live []*store.Session
	repos := map[string]bool{}
	m.mu.Lock()
	for _, s := range all {
		if s.State.Terminal() || s.RunID == "" {
			continue
		}
		repos[s.RepoRoot] = true
		r := &m.sandboxLocked(s.ID).rt
		r.checked = make(chan struct{})
		live = append(live, s)
	}
	m.mu.Unlock()
	if len(live) == 0 {
		return
	}
	m.restoreForwards(live)
	m.log.Info("rehydrating sessions", "count", len(live))
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		// The RWX CLI's files of these checkouts: adopt what they record,
		// and record the sessions there (they may predate sandboxd writing
		// them). After READY: a thousand checkouts take seconds, and the
		// file is read again before each create anyway.
		for root := range repos {
			if root != "" && ctx.Err() == nil {
				m.watchCLIFile(root)
				m.cliFileChanged(root)
			}
		}
		m.forEach(ctx, live, func(s *store.Session) {
			defer m.checkDone(s.ID)
			// Re-read: a client may have changed the session meanwhile.
			if cur, err := m.st.Get(s.ID); err == nil && !cur.State.Terminal() {
				m.check(ctx, cur)
			}
		})
		m.log.Info("rehydration done", "count", len(live))
	}()
}

func (m *Manager) checkDone(id string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if r, ok := m.runtimeLocked(id); ok && r.checked != nil && !isClosed(r.checked) {
		close(r.checked)
	}
}

// awaitCheck waits for the rehydration check of session id, if one runs,
// and reports whether there was one (the stored record may have changed).
func (m *Manager) awaitCheck(ctx context.Context, id string) bool {
	m.mu.Lock()
	var ch chan struct{}
	if r, ok := m.runtimeLocked(id); ok {
		ch = r.checked
	}
	m.mu.Unlock()
	if ch == nil {
		return false
	}
	select {
	case <-ch:
	case <-ctx.Done():
	}
	return true
}

// List reconciles (joining a pass in flight) and lists the sessions.
func (m *Manager) List(ctx context.Context, req ipc.ListRequest) (ipc.ListResponse, error) {
	resp := ipc.ListResponse{Sessions: []ipc.SessionInfo{}}
	if _, err := m.ReconcileNow(ctx); err != nil {
		if ctx.Err() != nil {
			return resp, ctx.Err()
		}
		resp.Warnings = append(resp.Warnings, fmt.Sprintf("could not check with the remote (%v): statuses are the last known ones", err))
	}
	m.flushExecRecords()
	all, err := m.st.List()
	if err != nil {
		return resp, err
	}
	for _, s := range all {
		if s.State.Terminal() && !req.All {
			continue
		}
		resp.Sessions = append(resp.Sessions, m.info(s))
	}
	return resp, nil
}

// Status probes the caller's session.
func (m *Manager) Status(ctx context.Context, req ipc.StatusRequest) (ipc.ProbeResponse, error) {
	s, p, err := m.lookupBranch(ctx, req)
	if errors.Is(err, errdefs.ErrNotFound) && p.RepoRoot != "" {
		// The local record may be lost while the run lives on.
		if adopted, aerr := m.adoptRemote(ctx, p); aerr != nil {
			return ipc.ProbeResponse{}, aerr
		} else if adopted != nil {
			s, err = adopted, nil
		}
	}
	if errors.Is(err, errdefs.ErrNotFound) && p.RepoRoot != "" {
		// No sandbox for this checkout is an answer, not a failure.
		detail := "no sandbox for this checkout, branch and config: `nook start` or `nook exec -- CMD` starts one"
		if _, err := os.Lstat(p.ConfigFile); errors.Is(err, os.ErrNotExist) {
			// start and exec would fail for lack of a config.
			detail = fmt.Sprintf("no sandbox, and no sandbox config at %s: create one with `nook init`, then `nook start` or `nook exec -- CMD` starts a sandbox", p.configRel())
		}
		return ipc.ProbeResponse{
			Session:   ipc.SessionInfo{RepoRoot: p.RepoRoot, Branch: p.Branch, ConfigFile: p.ConfigFile, Status: ProbeNoSandbox},
			Probe:     ProbeNoSandbox,
			Detail:    detail,
			Lifecycle: ipc.Lifecycle{State: ProbeNoSandbox},
		}, nil
	}
	if err != nil {
		return ipc.ProbeResponse{}, err
	}
	resp, err := m.probe(ctx, s)
	if err == nil {
		ri := m.opts.Remotes.Info()
		resp.Isolation = ri.Isolation
		if ri.Unisolated {
			resp.Warnings = append(resp.Warnings, UnisolatedWarning)
		}
	}
	return resp, err
}

// UnisolatedWarning is shown when the local remote runs sandbox commands
// without isolation.
const UnisolatedWarning = "the local remote runs sandbox commands WITHOUT isolation (configured isolation none): they run as your user with your home, files and network in reach"

// Probe probes one session by id.
func (m *Manager) Probe(ctx context.Context, id string) (ipc.ProbeResponse, error) {
	s, err := m.st.Get(id)
	if err != nil {
		if errors.Is(err, store.ErrNotFound) {
			return ipc.ProbeResponse{}, errdefs.NotFoundf("no session %s: `nook list --all` shows the known ones", id)
		}
		return ipc.ProbeResponse{}, err
	}
	return m.probe(ctx, s)
}

// probe answers connected / expired / no_sandbox / unknown for session s,
// checking the remote and, when sandboxable, the held connection (which also
// tells whether a sync snapshot exists in the sandbox).
func (m *Manager) probe(ctx context.Context, s *store.Session) (ipc.ProbeResponse, error) {
	m.awaitCheck(ctx, s.ID)
	outcome, detail, hasSnapshot := ProbeExpired, "", false
	if !s.State.Terminal() {
		if s.RunID == "" {
			outcome, detail = ProbeNoSandbox, "the run has not been created yet"
		} else {
			outcome = m.check(ctx, s)
			if outcome == ProbeConnected {
				cur, _ := m.st.Get(s.ID)
				if cur != nil {
					s = cur
				}
				var err error
				hasSnapshot, err = m.probeConnection(ctx, s)
				if err != nil {
					outcome, detail = ProbeUnknown, err.Error()
				}
			}
		}
	}
	now := m.now()
	m.flushExecRecords()
	if cur, err := m.st.Update(s.ID, func(s *store.Session) error { s.LastProbeAt = now; return nil }); err == nil {
		s = cur
	}
	if s.State.Terminal() {
		outcome, detail = ProbeExpired, s.StateReason
	} else if outcome == ProbeUnknown && detail == "" {
		detail = s.StateReason
	}
	resp := ipc.ProbeResponse{Session: m.info(s), Probe: outcome, Detail: detail, HasSnapshot: hasSnapshot, Lifecycle: lifecycle(s)}
	m.mu.Lock()
	if r, ok := m.runtimeLocked(s.ID); ok {
		if !r.expiresAt.IsZero() && outcome == ProbeConnected {
			t := r.expiresAt
			resp.ExpiresAt = &t
		}
	}
	m.mu.Unlock()
	return resp, nil
}

// probeConnection runs one command over the held connection: it proves the
// connection works and reports whether the sync snapshot ref exists.
func (m *Manager) probeConnection(ctx context.Context, s *store.Session) (bool, error) {
	conn, err := m.sandboxOf(s).link.Get(ctx, target(s))
	if err != nil {
		return false, fmt.Errorf("connect: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, probeCommandWait)
	defer cancel()
	out := newAnswer(16) // "yes" or "no"
	cmd := "git rev-parse -q --verify " + gitsync.SnapshotRef + " >/dev/null 2>&1 && echo yes || echo no"
	if _, err := conn.Exec(ctx, cmd, sshpool.Stdio{Stdout: out}); err != nil {
		return false, fmt.Errorf("run a probe command: %w", err)
	}
	return bytes.Equal(bytes.TrimSpace(out.Bytes()), []byte("yes")), nil
}

// probeCommandWait bounds the probe's one command.
const probeCommandWait = 20 * time.Second

func lifecycle(s *store.Session) ipc.Lifecycle {
	l := ipc.Lifecycle{State: string(s.State), Reason: s.StateReason, Created: s.CreatedAt, ExecCount: s.ExecCount}
	if !s.LastExecAt.IsZero() {
		t := s.LastExecAt
		l.LastExec = &t
	}
	if !s.LastProbeAt.IsZero() {
		t := s.LastProbeAt
		l.LastProbe = &t
	}
	return l
}

// remoteCallFailed says that action failed: a runs API error names the
// call already ("runs API: create run: ..."), so it is not said twice.
func remoteCallFailed(action string, err error) error {
	var apiErr *runsapi.APIError
	if errors.As(err, &apiErr) {
		return err
	}
	return fmt.Errorf("%s: %w", action, err)
}

// browserURL is the run URL worth showing: none for the local remote,
// whose run URL is its API's (it needs the token, and a browser refuses
// its certificate), RWX Cloud's as it is.
func (m *Manager) browserURL(url string) string {
	if m.opts.Remotes.Info().Name == "local" {
		return ""
	}
	return url
}

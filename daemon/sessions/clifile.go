package sessions

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/sandboxd/sandboxd/clifile"
	"github.com/sandboxd/sandboxd/daemon/repofile"
	"github.com/sandboxd/sandboxd/rwxapi"
	"github.com/sandboxd/sandboxd/store"
)

// Sharing sandboxes with the RWX CLI through its .rwx/sandboxes/sandboxes.json:
// sandboxd adopts what the CLI records there (read whenever the file
// changes), records its own sessions there the way the CLI does (so that
// `rwx sandbox exec` in the checkout finds them), and takes the CLI's lock
// around a create, as every CLI process does, so that the two tools never
// start two sandboxes for one checkout, branch and config. None of it is on
// the exec path.

// cliLockWait bounds waiting for the CLI's lock: a CLI process holds it
// for a few API calls at most.
const cliLockWait = 15 * time.Second

// cliConfirmWait bounds asking the remote to confirm the runs the CLI's
// file names.
const cliConfirmWait = 20 * time.Second

// readCLIFile adopts the sessions the CLI's file of repoRoot records that
// sandboxd does not know yet and the remote confirms, and returns them.
//
// The file lives in the working tree, where a pull from a sandbox (or any
// tool) can write it: what it says is a claim, never taken on its word. A
// run it names is adopted only when the remote, asked with the daemon's own
// token, lists it among the user's runs in progress with a cli_state that
// names this checkout, branch and config. The file's scoped token is never
// used: the daemon's own token reaches every run of the user.
func (m *Manager) readCLIFile(ctx context.Context, repoRoot string) ([]*store.Session, error) {
	path := clifile.Path(repoRoot)
	data, err := repofile.ReadFile(ctx, repoRoot, path, repofile.MaxFileBytes)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the RWX CLI's sandboxes file: %w", err)
	}
	legacy, err := store.ParseLegacy(path, data)
	if err != nil {
		return nil, err
	}
	// Most reads find only runs sandboxd knows (its own records): answer
	// those from the index without a call or a write transaction.
	var claims []cliClaim
	for _, l := range legacy {
		if l.RunID == "" || m.cliRefusedBefore(repoRoot, l) {
			continue
		}
		if _, err := m.st.ByRunID(l.RunID); !errors.Is(err, store.ErrNotFound) {
			continue
		}
		id, ok := cliIdentity(repoRoot, l)
		if !ok {
			continue
		}
		l.ScopedToken = "" // never trusted: see above
		claims = append(claims, cliClaim{l, id})
	}
	if len(claims) == 0 {
		return nil, nil
	}
	confirmed, err := m.confirmCLIClaims(ctx, repoRoot, claims)
	if err != nil || len(confirmed) == 0 {
		return nil, err
	}
	ids := make(map[string]store.Identity, len(confirmed))
	unknown := make([]store.LegacySession, 0, len(confirmed))
	for _, c := range confirmed {
		ids[c.l.Key] = c.id
		unknown = append(unknown, c.l)
	}
	adopted, err := m.st.AdoptLegacy(unknown, func(l store.LegacySession) (store.Identity, bool) {
		id, ok := ids[l.Key]
		return id, ok
	}, m.opts.Remotes.Info().Name)
	if err != nil {
		return nil, err
	}
	for _, s := range adopted {
		m.publish(eventSessionAdopted, s, map[string]string{"runUrl": m.browserURL(s.RunURL), "from": "rwx-cli"})
	}
	if len(adopted) > 0 {
		m.log.Info("adopted sessions of the RWX CLI", "repo", repoRoot, "count", len(adopted))
	}
	return adopted, nil
}

// cliClaim is a record of the CLI's file naming a run sandboxd does not
// know, and the identity it claims that run for.
type cliClaim struct {
	l  store.LegacySession
	id store.Identity
}

// cliIdentity is the identity record l of repoRoot's file claims its run
// for, when that is an identity of this checkout.
func cliIdentity(repoRoot string, l store.LegacySession) (store.Identity, bool) {
	cfg := l.ConfigFile
	if cfg == "" {
		cfg = DefaultConfigRel
	}
	if !filepath.IsAbs(cfg) {
		cfg = filepath.Join(repoRoot, cfg)
	}
	cfg = canonical(cfg)
	// `rwx sandbox list` records every active run of the user in the file
	// of the checkout it ran in: other checkouts' runs are adopted through
	// their own file or their cli_state.
	if !within(repoRoot, cfg) {
		return store.Identity{}, false
	}
	return store.Identity{RepoRoot: repoRoot, Branch: l.Branch, ConfigFile: cfg}, true
}

// confirmCLIClaims asks the remote, with the daemon's own token, which of
// claims are runs of the user in progress whose cli_state names the
// identity claimed, and returns those. Each claim refused is logged and
// published with its reason; an unanswered remote confirms nothing (the
// next read asks again).
func (m *Manager) confirmCLIClaims(ctx context.Context, repoRoot string, claims []cliClaim) ([]cliClaim, error) {
	ctx, cancel := context.WithTimeout(ctx, cliConfirmWait)
	defer cancel()
	remote, err := m.remote(ctx)
	if err != nil {
		return nil, fmt.Errorf("confirm the runs of the RWX CLI's sandboxes file with the remote (nothing adopted): %w", err)
	}
	runs := map[string]rwxapi.RunSummary{}
	listed, err := remote.ListSandboxes(ctx)
	if err != nil {
		return nil, fmt.Errorf("confirm the runs of the RWX CLI's sandboxes file with the remote (nothing adopted): %w", err)
	}
	for _, r := range listed {
		runs[r.ID] = r
	}
	missing := false
	for _, c := range claims {
		if _, ok := runs[c.l.RunID]; !ok {
			missing = true
		}
	}
	var moreErr error
	if missing {
		// A run the CLI just created is still provisioning: the list of
		// sandboxes does not show it yet.
		var more []rwxapi.RunSummary
		more, moreErr = remote.ListRunsInProgress(ctx)
		for _, r := range more {
			if _, ok := runs[r.ID]; !ok {
				runs[r.ID] = r
			}
		}
	}
	var confirmed []cliClaim
	for _, c := range claims {
		run, ok := runs[c.l.RunID]
		var reason string
		switch {
		case !ok && moreErr != nil:
			// Not known either way: asked again at the next read.
			m.log.Warn("cannot confirm the run named in the RWX CLI's sandboxes file; not adopting it for now",
				"repo", repoRoot, "key", c.l.Key, "run", c.l.RunID, "err", moreErr)
			continue
		case !ok:
			reason = "the remote does not list it among your runs in progress"
		case !m.namesCheckout(run, c.id):
			reason = "its cli_state on the remote does not name this checkout, branch and config"
		default:
			confirmed = append(confirmed, c)
			continue
		}
		m.refuseCLIClaim(repoRoot, c, reason)
	}
	return confirmed, nil
}

// namesCheckout reports whether run's cli_state names identity id: the
// checkout itself (sandboxd's repoRoot, or the CLI's absolute config path),
// the branch and the config. A state relative to some repository names no
// checkout and confirms nothing.
func (m *Manager) namesCheckout(run rwxapi.RunSummary, id store.Identity) bool {
	claimed, ok := m.identityOf(run)
	return ok && claimed.Branch == id.Branch &&
		canonical(claimed.RepoRoot) == id.RepoRoot && canonical(claimed.ConfigFile) == id.ConfigFile
}

// refuseCLIClaim says why the run of claim c is not adopted, once per
// checkout, record and run.
func (m *Manager) refuseCLIClaim(repoRoot string, c cliClaim, reason string) {
	m.mu.Lock()
	m.cliRefused[cliRefusalKey(repoRoot, c.l)] = true
	m.mu.Unlock()
	m.log.Warn("not adopting the run named in the RWX CLI's sandboxes file", "repo", repoRoot, "key", c.l.Key, "run", c.l.RunID, "reason", reason)
	m.opts.Events.Publish(eventAdoptionRefused, "", c.l.RunID, map[string]string{
		"repo": repoRoot, "key": c.l.Key, "branch": c.id.Branch, "from": "rwx-cli",
		"reason": reason + "; sandboxd uses its own sandbox for this branch",
	})
}

// cliRefusedBefore reports whether record l of repoRoot's file was refused
// already: a run's cli_state does not change, so it is not asked again.
func (m *Manager) cliRefusedBefore(repoRoot string, l store.LegacySession) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.cliRefused[cliRefusalKey(repoRoot, l)]
}

func cliRefusalKey(repoRoot string, l store.LegacySession) string {
	return repoRoot + "\x00" + l.Key + "\x00" + l.RunID
}

// watchCLIFile reads the CLI's file of repoRoot again whenever it changes,
// from now until Close.
func (m *Manager) watchCLIFile(repoRoot string) {
	if m.opts.Watcher == nil || repoRoot == "" {
		return
	}
	m.mu.Lock()
	if _, ok := m.cliWatches[repoRoot]; ok || m.closing {
		m.mu.Unlock()
		return
	}
	m.cliWatches[repoRoot] = nil // reserved: concurrent callers must not double-watch
	m.mu.Unlock()
	// Off the watcher's goroutine: a read may wait for the remote's answer,
	// and other watches (branches) must not wait for it.
	cancel, err := m.opts.Watcher.WatchFile(clifile.Path(repoRoot), func() { m.cliFileRead(repoRoot) })
	m.mu.Lock()
	defer m.mu.Unlock()
	if err != nil {
		// Kept reserved: the file is still read before each create.
		m.log.Warn("watch the RWX CLI's sandboxes file; it is read before each create instead", "repo", repoRoot, "err", err)
		return
	}
	if m.closing {
		cancel()
		return
	}
	m.cliWatches[repoRoot] = cancel
	m.mu.Unlock()
	m.cliFileRead(repoRoot) // what changed before the watch began
	m.mu.Lock()
}

// cliFileRead reads the CLI's file of repoRoot again in the background;
// changes seen while a read is in flight are folded into one more read.
func (m *Manager) cliFileRead(repoRoot string) {
	m.mu.Lock()
	if m.closing {
		m.mu.Unlock()
		return
	}
	if again, ok := m.cliReads[repoRoot]; ok {
		*again = true
		m.mu.Unlock()
		return
	}
	again := new(bool)
	m.cliReads[repoRoot] = again
	m.wg.Add(1)
	m.mu.Unlock()
	go func() {
		defer m.wg.Done()
		for {
			ctx, cancel := context.WithTimeout(context.Background(), cliConfirmWait)
			if _, err := m.readCLIFile(ctx, repoRoot); err != nil {
				m.log.Warn("read the RWX CLI's sandboxes file", "repo", repoRoot, "err", err)
			}
			cancel()
			m.mu.Lock()
			if !*again {
				delete(m.cliReads, repoRoot)
				m.mu.Unlock()
				return
			}
			*again = false
			m.mu.Unlock()
		}
	}()
}

// lockCLIFileFor is lockCLIFile for a create or reset of p, except when
// p's config does not exist: no CLI can create a run without it either,
// and taking the lock would leave .rwx/sandboxes (its .gitignore and the
// lock file) in a checkout where the create is about to fail.
func (m *Manager) lockCLIFileFor(ctx context.Context, p place) func() {
	if _, err := os.Lstat(p.ConfigFile); errors.Is(err, os.ErrNotExist) {
		if _, err := os.Lstat(filepath.Dir(clifile.Path(p.RepoRoot))); errors.Is(err, os.ErrNotExist) {
			return func() {}
		}
	}
	return m.lockCLIFile(ctx, p.RepoRoot)
}

// lockCLIFile takes the CLI's lock of repoRoot's file. When it cannot (a
// read-only checkout, a CLI process stuck holding it), the create goes on
// without it: the lock only narrows the window in which both tools could
// create at once.
func (m *Manager) lockCLIFile(ctx context.Context, repoRoot string) func() {
	ctx, cancel := context.WithTimeout(ctx, cliLockWait)
	defer cancel()
	unlock, err := clifile.Lock(ctx, repoRoot)
	if err != nil {
		m.log.Warn("create without the RWX CLI's lock", "repo", repoRoot, "err", err)
		return func() {}
	}
	return unlock
}

// cliFileChanged brings the CLI's file of repoRoot up to date with the
// store in the background (the CLI's lock may be held for a while); calls
// made meanwhile are folded into one more pass.
func (m *Manager) cliFileChanged(repoRoot string) {
	if repoRoot == "" {
		return
	}
	m.mu.Lock()
	if m.closing {
		m.mu.Unlock()
		return
	}
	if again, ok := m.cliWrites[repoRoot]; ok {
		*again = true
		m.mu.Unlock()
		return
	}
	again := new(bool)
	m.cliWrites[repoRoot] = again
	m.wg.Add(1)
	m.mu.Unlock()
	go func() {
		defer m.wg.Done()
		for {
			ctx, cancel := context.WithTimeout(context.Background(), cliLockWait)
			if err := m.writeCLIFile(ctx, repoRoot, false); err != nil {
				m.log.Warn("update the RWX CLI's sandboxes file", "repo", repoRoot, "err", err)
			}
			cancel()
			m.mu.Lock()
			if !*again {
				delete(m.cliWrites, repoRoot)
				m.mu.Unlock()
				return
			}
			*again = false
			m.mu.Unlock()
		}
	}()
}

// writeCLIFile records sandboxd's live sessions of repoRoot in the CLI's
// file under the CLI's keys and removes the records of runs sandboxd saw
// end. Every other record is left as the CLI wrote it, including a CLI
// record of another live run for the same key (the CLI keeps using its
// run). locked says the caller holds the CLI's lock. The file is only
// created when there is something to record, and only replaced when its
// content changes.
func (m *Manager) writeCLIFile(ctx context.Context, repoRoot string, locked bool) error {
	all, err := m.st.List()
	if err != nil {
		return err
	}
	var live []*store.Session
	ended := map[string]bool{}
	for _, s := range all {
		if s.RepoRoot != repoRoot || s.RunID == "" {
			continue
		}
		if s.State.Terminal() {
			ended[s.RunID] = true
			continue
		}
		// A run attached with --id beside the checkout's session has no
		// key of its own in the CLI's scheme.
		if s.Branch != "" && filepath.IsAbs(s.ConfigFile) {
			live = append(live, s)
		}
	}
	path := clifile.Path(repoRoot)
	if len(live) == 0 {
		if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
			return nil
		}
	}
	if !locked {
		unlock, err := clifile.Lock(ctx, repoRoot)
		if err != nil {
			return err
		}
		defer unlock()
	}
	data, err := repofile.ReadFile(ctx, repoRoot, path, repofile.MaxFileBytes)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("read the RWX CLI's sandboxes file: %w", err) // never replace a file that cannot be read
	}
	f, err := clifile.Parse(path, data)
	if err != nil {
		return err
	}
	changed := false
	for _, key := range f.Keys() {
		if e, _, err := f.Get(key); err == nil && ended[e.RunID] {
			f.Delete(key)
			changed = true
		}
	}
	for _, s := range live {
		key, err := clifile.Key(s.Branch, s.ConfigFile)
		if err != nil {
			continue
		}
		e, ok, err := f.Get(key)
		if err == nil && ok && e.RunID == s.RunID {
			continue
		}
		if ok && (err != nil || e.RunID != "") {
			m.log.Info("the RWX CLI records another run for this checkout, branch and config; leaving its record",
				"repo", repoRoot, "key", key, "run", s.RunID, "cliRun", e.RunID)
			continue
		}
		// The scoped token stays in sandboxd's store only: without one the
		// CLI uses its own access token.
		entry := clifile.Entry{RunID: s.RunID, ConfigFile: s.ConfigFile, RunURL: s.RunURL, ConfigHash: s.ConfigHash}
		if !s.CreatedAt.IsZero() {
			t := s.CreatedAt.UTC()
			entry.CreatedAt = &t
		}
		f.Set(key, entry)
		changed = true
	}
	if !changed {
		return nil
	}
	return f.Write(repoRoot)
}

package sessions

import (
	"context"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// watchConfig starts watching the config file of a live session for drift:
// a change of content away from the hash recorded at start emits one
// config.drift event and makes the next execs warn.
func (m *Manager) watchConfig(s *store.Session) {
	if m.opts.Watcher == nil || s.ConfigFile == "" {
		return
	}
	r := m.rt(s.ID)
	m.mu.Lock()
	if r.cancelWatch != nil {
		m.mu.Unlock()
		return
	}
	r.cancelWatch = func() {} // reserve: concurrent callers must not double-watch
	m.mu.Unlock()
	id, runID, startHash, file, root := s.ID, s.RunID, s.ConfigHash, s.ConfigFile, s.RepoRoot
	cancel, err := m.opts.Watcher.WatchFile(file, func() {
		h := hashFile(root, file)
		m.mu.Lock()
		r, ok := m.runtimeLocked(id)
		if !ok {
			m.mu.Unlock()
			return
		}
		drifted := h != startHash
		emit := drifted && h != r.driftHash
		r.drift = drifted
		if drifted {
			r.driftHash = h
		} else {
			r.driftHash = ""
		}
		m.mu.Unlock()
		if emit {
			m.opts.Events.Publish(eventConfigDrift, id, runID, map[string]string{"configFile": file})
		}
	})
	m.mu.Lock()
	defer m.mu.Unlock()
	if err != nil {
		m.log.Warn("watch config file; drift is checked per exec instead", "file", file, "err", err)
		r.cancelWatch = nil
		return
	}
	if cur, ok := m.runtimeLocked(id); !ok || cur != r {
		// The session ended while the watch was being set up.
		cancel()
		return
	}
	r.cancelWatch = cancel
}

// drifted reports whether session s's config changed since it started.
func (m *Manager) drifted(s *store.Session) bool {
	if s.ConfigHash == "" {
		return false
	}
	if m.opts.Watcher != nil {
		m.mu.Lock()
		r, ok := m.runtimeLocked(s.ID)
		watching := ok && r.cancelWatch != nil
		drift := ok && r.drift
		m.mu.Unlock()
		if watching {
			return drift
		}
	}
	return hashFile(s.RepoRoot, s.ConfigFile) != s.ConfigHash
}

// driftWarning is the drift warning an exec of session s prints: once per
// change of the config (not on every exec), worded as `nook status` words it.
func (m *Manager) driftWarning(s *store.Session) string {
	if !m.drifted(s) {
		return ""
	}
	h := hashFile(s.RepoRoot, s.ConfigFile)
	r := m.rt(s.ID)
	m.mu.Lock()
	defer m.mu.Unlock()
	if r.driftWarned == h {
		return ""
	}
	r.driftWarned = h
	return ipc.DriftWarning(s.ConfigFile)
}

// Close stops background work and waits for it.
func (m *Manager) Close(ctx context.Context) error {
	// Other clients of the sandboxes must not wait for leases to idle out.
	m.endAll(ctx)
	m.mu.Lock()
	for _, cancel := range m.cliWatches {
		if cancel != nil {
			cancel()
		}
	}
	for _, c := range m.sandboxes {
		r := &c.rt
		if r.cancelWatch != nil {
			r.cancelWatch()
			r.cancelWatch = nil
		}
	}
	m.mu.Unlock()
	done := make(chan struct{})
	go func() { m.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

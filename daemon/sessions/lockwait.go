package sessions

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// Defaults of Options.LockTimeout and Options.ProbeTimeout.
const (
	// DefaultLockTimeout bounds the wait for the sandbox agent's lock: a
	// lock held longer is most likely held by a connection nobody uses any
	// more (RWX's agent may keep a silent one for long).
	DefaultLockTimeout = 10 * time.Minute
	// DefaultProbeTimeout is how long a connection may leave a keepalive
	// unanswered while a lock request waits on it before it is taken for
	// dead and replaced.
	DefaultProbeTimeout = 5 * time.Second
	// DefaultQueueTimeout bounds the wait for one's turn in a sandbox's
	// queue: the commands ahead may legitimately run for long.
	DefaultQueueTimeout = time.Hour
)

// waitBounds returns the bounds of the lock wait: the wait itself and the
// probe of the connection it waits on.
func (m *Manager) waitBounds() (lock, probe time.Duration) {
	m.mu.Lock()
	lock, probe = m.daemonCfg.LockTimeout, m.daemonCfg.ProbeTimeout
	m.mu.Unlock()
	if lock <= 0 {
		lock = DefaultLockTimeout
	}
	if probe <= 0 {
		probe = DefaultProbeTimeout
	}
	return lock, probe
}

// DefaultReattachTimeout bounds a held command's wait for a new
// connection once its own was lost.
const DefaultReattachTimeout = 2 * time.Minute

// reattachTimeout returns the bound of a held command's reattach.
func (m *Manager) reattachTimeout() time.Duration {
	m.mu.Lock()
	d := m.daemonCfg.ReattachTimeout
	m.mu.Unlock()
	if d <= 0 {
		d = DefaultReattachTimeout
	}
	return d
}

// queueTimeout returns the bound of the wait in a sandbox's queue.
func (m *Manager) queueTimeout() time.Duration {
	m.mu.Lock()
	d := m.daemonCfg.QueueTimeout
	m.mu.Unlock()
	if d <= 0 {
		d = DefaultQueueTimeout
	}
	return d
}

// A lock wait probes its connection after probeAfter, then every
// probeEvery; it says what it waits for after sayAfter, then with every
// answered probe.
const (
	probeAfter = 200 * time.Millisecond
	probeEvery = 5 * time.Second
	sayAfter   = time.Second
)

// lostHolder is a connection of this daemon that held the lock and was
// lost without its unlock being confirmed (it went silent, or broke): the
// agent keeps the lock until it notices.
type lostHolder struct {
	since time.Time // when it took the lock
	lost  time.Time // when this daemon gave up on it
}

type lockProgressKey struct{}

// withLockProgress makes the lock waits under ctx tell say what they wait
// for.
func withLockProgress(ctx context.Context, say func(string)) context.Context {
	return context.WithValue(ctx, lockProgressKey{}, say)
}

func lockProgress(ctx context.Context) func(string) {
	if say, ok := ctx.Value(lockProgressKey{}).(func(string)); ok {
		return say
	}
	return func(string) {}
}

// noteLostHolder records that conn, which held l's lock, is gone without
// a confirmed unlock. The caller holds l.mu.
func (m *Manager) noteLostHolderLocked(l *lease) {
	if l.conn == nil {
		return
	}
	if l.lost == nil {
		l.lost = &lostHolder{since: l.since, lost: m.now()}
	}
	l.conn = nil
}

// lockHolderText says who holds the lock this daemon waits for.
func (m *Manager) lockHolderText(l *lease) string {
	l.mu.Lock()
	lost := l.lost
	l.mu.Unlock()
	if lost == nil {
		return "held by another client of the sandbox"
	}
	return fmt.Sprintf("held since %s by this machine's connection that went silent (lost at %s; the sandbox frees it once it notices)",
		lost.since.Local().Format("15:04:05"), lost.lost.Local().Format("15:04:05"))
}

// requestLock asks the agent for its lock on conn and waits for it, at
// most until deadline. Meanwhile conn is probed: a connection that went
// silent fails the request (ErrKeepaliveTimeout, safe to retry on a new
// connection) instead of leaving it waiting for ever; on a live one the
// wait is reported, with whom it waits for, through ctx's lock progress.
// since is when the caller began to wait for the lock.
func (m *Manager) requestLock(ctx context.Context, s *store.Session, l *lease, conn *sshpool.Conn, since, deadline time.Time) error {
	say := lockProgress(ctx)
	lockTimeout, probeTimeout := m.waitBounds()
	lctx, cancel := context.WithCancel(ctx)
	// Every goroutine of the wait ends with it: cancel first, then wait.
	var waits sync.WaitGroup
	defer waits.Wait()
	defer cancel()
	granted := make(chan error, 1)
	waits.Go(func() { granted <- m.directive(lctx, conn, directiveLock) })
	probed := make(chan error, 1)
	probe := func() { waits.Go(func() { probed <- conn.Probe(lctx, probeTimeout) }) }
	answered := false // the connection answered a probe: it is alive
	waiting := func() {
		who := "the connection has not answered a probe yet"
		if answered {
			who = m.lockHolderText(l)
		}
		say(fmt.Sprintf("%s since %s (%s), %s", ipc.WaitingForLock, since.Local().Format("15:04:05"),
			m.now().Sub(since).Round(time.Second), who))
	}
	// A lock granted at once (the common case) costs neither a probe nor
	// a word.
	again := time.After(probeAfter)
	sayNow := time.After(sayAfter)
	timeout := time.NewTimer(max(time.Until(deadline), 0))
	defer timeout.Stop()
	for {
		select {
		case err := <-granted:
			return err
		case <-sayNow:
			sayNow = nil
			waiting()
		case err := <-probed:
			if err != nil && ctx.Err() == nil {
				// Probe closed the connection: the request ends with it and
				// is retried on a new one (taking the lock is safe to
				// repeat).
				say(fmt.Sprintf("%s (no answer within %s); reconnecting", ipc.WaitingSilent, probeTimeout))
				cancel()
				<-granted
				return fmt.Errorf("%w: %w", sshpool.ErrConnectionLost, err)
			}
			answered = true
			if sayNow == nil {
				waiting()
			}
			again = time.After(probeEvery)
		case <-again:
			again = nil
			probe()
		case <-timeout.C:
			cancel()
			if err := <-granted; err == nil {
				// Granted as it was given up: hand it back.
				m.unlockLost(l, s.RunID, conn)
			}
			return errdefs.Unavailable(&lockTimeoutError{msg: fmt.Sprintf("the sandbox's lock is still not granted after %s (%s); the command did not run: retry later, or run `nook reset` for a new sandbox (lock_timeout in sandboxd's config sets this bound)",
				lockTimeout, m.lockHolderText(l))})
		case <-ctx.Done():
			cancel()
			if err := <-granted; err == nil {
				m.unlockLost(l, s.RunID, conn)
			}
			return fmt.Errorf("acquire the sandbox lock: %w", ctx.Err())
		}
	}
}

// connectSaying is connect, telling the lock progress of ctx what it waits
// for when it takes long (a handshake, then maybe a runs API call, each
// bounded by its own timeout).
func (m *Manager) connectSaying(ctx context.Context, s *store.Session) (*sshpool.Conn, error) {
	say := lockProgress(ctx)
	since := m.now()
	done := make(chan struct{})
	var said sync.WaitGroup
	defer said.Wait()
	defer close(done)
	said.Go(func() {
		select {
		case <-done:
		case <-time.After(sayAfter):
			say(fmt.Sprintf("%s %s (SSH handshake; if it fails, the remote is asked about the sandbox)", ipc.WaitingConnect, since.Local().Format("15:04:05")))
		}
	})
	return m.connect(ctx, s)
}

// lockTimeoutError is a lock wait that reached its bound.
type lockTimeoutError struct{ msg string }

func (e *lockTimeoutError) Error() string { return e.msg }

// unlockLost releases a lock granted to a request that was given up.
func (m *Manager) unlockLost(l *lease, runID string, conn *sshpool.Conn) {
	l.owner.spawn(func() {
		ctx, cancel := context.WithTimeout(context.Background(), unlockTimeout)
		defer cancel()
		if _, err := conn.ExecOnce(ctx, directiveUnlock, sshpool.Stdio{}); err != nil {
			m.log.Debug("release a lock granted too late", "run", runID, "err", err)
		}
	})
}

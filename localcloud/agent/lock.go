package agent

import (
	"context"
	"sync"
)

// fifoLock is the sandbox-wide lock behind __rwx_sandbox_lock_requested__:
// granted in request order across connections, owned by the connection that
// asked for it, and released when that connection goes away so that a
// crashed client never deadlocks the sandbox.
type fifoLock struct {
	mu      sync.Mutex
	holder  uint64 // connection id; 0 when free
	waiters []*lockWaiter
}

type lockWaiter struct {
	owner   uint64
	granted chan struct{}
}

// acquire blocks until owner holds the lock or ctx ends. A connection that
// already holds the lock gets it again at once (requests are idempotent, so
// a client cannot deadlock on itself).
func (l *fifoLock) acquire(ctx context.Context, owner uint64) error {
	l.mu.Lock()
	if l.holder == 0 || l.holder == owner {
		l.holder = owner
		l.mu.Unlock()
		return nil
	}
	w := &lockWaiter{owner: owner, granted: make(chan struct{})}
	l.waiters = append(l.waiters, w)
	l.mu.Unlock()

	select {
	case <-w.granted:
		return nil
	case <-ctx.Done():
		l.mu.Lock()
		defer l.mu.Unlock()
		select {
		case <-w.granted:
			// Granted while giving up: pass it on rather than leak it.
			if l.holder == owner {
				l.handOffLocked()
			}
		default:
			l.removeLocked(w)
		}
		return ctx.Err()
	}
}

// release frees the lock if owner holds it. Releasing a lock one does not
// hold is a no-op, like the real agent.
func (l *fifoLock) release(owner uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.holder == owner {
		l.handOffLocked()
	}
}

// releaseOwner drops everything owner holds or waits for (its connection
// closed).
func (l *fifoLock) releaseOwner(owner uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	kept := l.waiters[:0]
	for _, w := range l.waiters {
		if w.owner != owner {
			kept = append(kept, w)
		}
	}
	l.waiters = kept
	if l.holder == owner {
		l.handOffLocked()
	}
}

func (l *fifoLock) handOffLocked() {
	l.holder = 0
	if len(l.waiters) == 0 {
		return
	}
	next := l.waiters[0]
	l.waiters = l.waiters[1:]
	l.holder = next.owner
	close(next.granted)
}

func (l *fifoLock) removeLocked(w *lockWaiter) {
	for i, x := range l.waiters {
		if x == w {
			l.waiters = append(l.waiters[:i], l.waiters[i+1:]...)
			return
		}
	}
}

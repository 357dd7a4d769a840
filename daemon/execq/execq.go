// Package execq serializes work per key (one sandbox = one key) inside the
// daemon process: one holder at a time per key, waiters served in arrival
// order, different keys fully in parallel. It replaces the flock on a JSON
// file that one-process-per-command clients need.
package execq

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// PositionEvery is how often a waiter looks at its place in line to report
// a change. Waiters look for themselves rather than being told on every
// release: with n callers waiting, telling each of them about each release
// costs n wake-ups and n progress frames per exec (docs/performance.md).
const PositionEvery = 500 * time.Millisecond

// Queue is a set of FIFO lines, one per key. The zero value is not usable;
// call New.
type Queue struct {
	mu    sync.Mutex
	lines map[string]*line
	every time.Duration // PositionEvery; shorter in tests
}

// line is the state of one key: the current holder and who waits behind it.
// Invariant: waiters is non-empty only while held is true (a release hands
// the key to the first waiter at once).
type line struct {
	held    bool
	holder  *ticket
	waiters []*ticket
}

// ticket is one Acquire call.
type ticket struct {
	granted  chan struct{} // closed when the ticket becomes the holder
	released bool
}

// New returns an empty queue.
func New() *Queue {
	return &Queue{lines: make(map[string]*line), every: PositionEvery}
}

// Acquire waits until the caller holds key, in arrival order, and returns
// the function that releases it (safe to call more than once).
//
// onPosition, when not nil, is called from the caller's goroutine with the
// number of callers ahead (holder included) when the caller has to wait, and
// then every PositionEvery while that number has changed. It is not called
// when the key is free, and never under the queue's lock.
//
// When ctx ends before the key is granted, the caller leaves the line (the
// ones behind it move up) and ctx's error is returned.
func (q *Queue) Acquire(ctx context.Context, key string, onPosition func(position int)) (release func(), err error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("wait for %s: %w", key, err)
	}
	t := &ticket{granted: make(chan struct{})}

	q.mu.Lock()
	l := q.lines[key]
	if l == nil {
		l = &line{}
		q.lines[key] = l
	}
	if !l.held {
		l.held, l.holder = true, t
		q.mu.Unlock()
		return q.releaser(key, t), nil
	}
	l.waiters = append(l.waiters, t)
	position := len(l.waiters)
	q.mu.Unlock()

	reported := 0
	report := func(p int) {
		if onPosition != nil && p > 0 && p != reported {
			reported = p
			onPosition(p)
		}
	}
	report(position)
	var look <-chan time.Time
	if onPosition != nil {
		tick := time.NewTicker(q.every)
		defer tick.Stop()
		look = tick.C
	}
	for {
		select {
		case <-t.granted:
			return q.releaser(key, t), nil
		case <-look:
			report(q.position(key, t))
		case <-ctx.Done():
			if q.leave(key, t) {
				return nil, fmt.Errorf("wait for %s: %w", key, ctx.Err())
			}
			// Granted while ctx ended: the caller will not use the key, so
			// pass it on at once.
			q.release(key, t)
			return nil, fmt.Errorf("wait for %s: %w", key, ctx.Err())
		}
	}
}

// Len returns how many callers hold or wait for key.
func (q *Queue) Len(key string) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	l := q.lines[key]
	if l == nil {
		return 0
	}
	n := len(l.waiters)
	if l.held {
		n++
	}
	return n
}

func (q *Queue) releaser(key string, t *ticket) func() {
	return func() { q.release(key, t) }
}

// release hands key from holder t to the first waiter. Releasing twice, or
// releasing a ticket that no longer holds the key, does nothing.
func (q *Queue) release(key string, t *ticket) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if t.released {
		return
	}
	t.released = true
	l := q.lines[key]
	if l == nil || l.holder != t {
		return
	}
	if len(l.waiters) == 0 {
		delete(q.lines, key)
		return
	}
	next := l.waiters[0]
	l.waiters[0] = nil
	l.waiters = l.waiters[1:]
	l.holder = next
	close(next.granted)
}

// leave removes waiting ticket t from key's line. It reports false when t was
// granted meanwhile (it then holds the key).
func (q *Queue) leave(key string, t *ticket) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	l := q.lines[key]
	if l == nil || l.holder == t {
		return false
	}
	for i, w := range l.waiters {
		if w == t {
			l.waiters = append(l.waiters[:i], l.waiters[i+1:]...)
			return true
		}
	}
	return false
}

// position returns t's current number of callers ahead, 0 once granted.
func (q *Queue) position(key string, t *ticket) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	if l := q.lines[key]; l != nil {
		for i, w := range l.waiters {
			if w == t {
				return i + 1
			}
		}
	}
	return 0
}

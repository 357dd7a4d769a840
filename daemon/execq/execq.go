// Package execq serializes the work on one sandbox inside the daemon
// process: a Line has one holder at a time, waiters served in arrival
// order; each sandbox's controller owns its own Line, so different
// sandboxes run fully in parallel. It replaces the flock on a JSON file
// that one-process-per-command clients need.
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

// Line is one FIFO: the current holder and who waits behind it. The zero
// value is not usable; call NewLine.
// Invariant: waiters is non-empty only while held is true (a release hands
// the line to the first waiter at once).
type Line struct {
	mu      sync.Mutex
	held    bool
	holder  *ticket
	waiters []*ticket
	every   time.Duration // PositionEvery; shorter in tests
}

// ticket is one Acquire call.
type ticket struct {
	granted  chan struct{} // closed when the ticket becomes the holder
	released bool
}

// NewLine returns an empty line.
func NewLine() *Line {
	return &Line{every: PositionEvery}
}

// Acquire waits until the caller holds the line, in arrival order, and
// returns the function that releases it (safe to call more than once).
//
// onPosition, when not nil, is called from the caller's goroutine with the
// number of callers ahead (holder included) when the caller has to wait, and
// then every PositionEvery while that number has changed. It is not called
// when the line is free, and never under the line's lock.
//
// When ctx ends before the line is granted, the caller leaves the line (the
// ones behind it move up) and ctx's error is returned.
func (q *Line) Acquire(ctx context.Context, onPosition func(position int)) (release func(), err error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("wait for the sandbox's queue: %w", err)
	}
	t := &ticket{granted: make(chan struct{})}

	q.mu.Lock()
	if !q.held {
		q.held, q.holder = true, t
		q.mu.Unlock()
		return q.releaser(t), nil
	}
	q.waiters = append(q.waiters, t)
	position := len(q.waiters)
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
			return q.releaser(t), nil
		case <-look:
			report(q.position(t))
		case <-ctx.Done():
			if q.leave(t) {
				return nil, fmt.Errorf("wait for the sandbox's queue: %w", ctx.Err())
			}
			// Granted while ctx ended: the caller will not use the line, so
			// pass it on at once.
			q.release(t)
			return nil, fmt.Errorf("wait for the sandbox's queue: %w", ctx.Err())
		}
	}
}

// Len returns how many callers hold or wait for the line.
func (q *Line) Len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	n := len(q.waiters)
	if q.held {
		n++
	}
	return n
}

func (q *Line) releaser(t *ticket) func() {
	return func() { q.release(t) }
}

// release hands the line from holder t to the first waiter. Releasing
// twice, or releasing a ticket that no longer holds the line, does nothing.
func (q *Line) release(t *ticket) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if t.released {
		return
	}
	t.released = true
	l := q // the line's fields, under q.mu
	if l.holder != t {
		return
	}
	if len(l.waiters) == 0 {
		l.held, l.holder = false, nil
		return
	}
	next := l.waiters[0]
	l.waiters[0] = nil
	l.waiters = l.waiters[1:]
	l.holder = next
	close(next.granted)
}

// leave removes waiting ticket t from the line. It reports false when t
// was granted meanwhile (it then holds the line).
func (q *Line) leave(t *ticket) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	l := q // the line's fields, under q.mu
	if l.holder == t {
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
func (q *Line) position(t *ticket) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	for i, w := range q.waiters {
		if w == t {
			return i + 1
		}
	}
	return 0
}

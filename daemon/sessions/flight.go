package sessions

import (
	"context"
	"sync"
	"time"
)

// flight runs one shared call per key: concurrent callers with the same key
// join the call in flight instead of starting their own (no duplicate runs,
// no reconcile storms). The work runs detached from any one caller's context,
// so a caller that goes away does not fail the others; each caller waits only
// as long as its own context allows.
type flight[T any] struct {
	mu    sync.Mutex
	calls map[string]*flightCall[T]
}

type flightCall[T any] struct {
	done chan struct{}
	val  T
	err  error
}

func (f *flight[T]) do(ctx context.Context, key string, timeout time.Duration, fn func(context.Context) (T, error)) (T, error) {
	f.mu.Lock()
	if f.calls == nil {
		f.calls = make(map[string]*flightCall[T])
	}
	c, ok := f.calls[key]
	if !ok {
		c = &flightCall[T]{done: make(chan struct{})}
		f.calls[key] = c
		workCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
		go func() {
			defer cancel()
			c.val, c.err = fn(workCtx)
			f.mu.Lock()
			delete(f.calls, key)
			f.mu.Unlock()
			close(c.done)
		}()
	}
	f.mu.Unlock()
	select {
	case <-c.done:
		return c.val, c.err
	case <-ctx.Done():
		var zero T
		return zero, ctx.Err()
	}
}

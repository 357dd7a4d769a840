package execq

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// waitLen waits until the line has n callers holding or waiting.
func waitLen(t *testing.T, q *Line, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for q.Len() != n {
		if time.Now().After(deadline) {
			t.Fatalf("Len() = %d, want %d", q.Len(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestFreeLineIsGrantedAtOnce(t *testing.T) {
	q := NewLine()
	called := false
	release, err := q.Acquire(context.Background(), func(int) { called = true })
	if err != nil {
		t.Fatal(err)
	}
	if called {
		t.Error("onPosition called for a free key")
	}
	if q.Len() != 1 {
		t.Errorf("Len = %d, want 1", q.Len())
	}
	release()
	release() // idempotent
	if q.Len() != 0 {
		t.Errorf("Len after release = %d, want 0", q.Len())
	}
}

// Thirty callers arrive one after the other while the key is held; they run
// strictly one at a time, in arrival order.
func TestThirtyRunOneAtATimeInArrivalOrder(t *testing.T) {
	q := NewLine()
	const n = 30
	first, err := q.Acquire(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var (
		running atomic.Int32
		mu      sync.Mutex
		order   []int
		wg      sync.WaitGroup
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			release, err := q.Acquire(context.Background(), nil)
			if err != nil {
				t.Error(err)
				return
			}
			defer release()
			if r := running.Add(1); r != 1 {
				t.Errorf("%d holders at once", r)
			}
			mu.Lock()
			order = append(order, i)
			mu.Unlock()
			time.Sleep(100 * time.Microsecond) // widen the window an overlap would need
			running.Add(-1)
		}()
		waitLen(t, q, i+2) // caller i is in line before caller i+1 starts
	}
	first()
	wg.Wait()
	if len(order) != n {
		t.Fatalf("%d callers ran, want %d", len(order), n)
	}
	for i, got := range order {
		if got != i {
			t.Fatalf("run order %v is not arrival order", order)
		}
	}
	if q.Len() != 0 {
		t.Errorf("Len = %d after all released", q.Len())
	}
}

func TestCancelledWaiterLeavesAndOthersMoveUp(t *testing.T) {
	q := NewLine()
	q.every = time.Millisecond // waiters look at their place often
	hold, _ := q.Acquire(context.Background(), nil)

	type waiter struct {
		positions chan int
		granted   chan func()
		cancel    context.CancelFunc
		err       chan error
	}
	start := func() *waiter {
		ctx, cancel := context.WithCancel(context.Background())
		w := &waiter{positions: make(chan int, 10), granted: make(chan func(), 1), cancel: cancel, err: make(chan error, 1)}
		go func() {
			release, err := q.Acquire(ctx, func(p int) { w.positions <- p })
			if err != nil {
				w.err <- err
				return
			}
			w.granted <- release
		}()
		return w
	}
	expect := func(w *waiter, want int) {
		t.Helper()
		select {
		case p := <-w.positions:
			if p != want {
				t.Fatalf("position %d, want %d", p, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("no position update (want %d)", want)
		}
	}
	a := start()
	expect(a, 1)
	b := start()
	expect(b, 2)
	c := start()
	expect(c, 3)

	b.cancel()
	select {
	case err := <-b.err:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled waiter: %v, want context.Canceled", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("cancelled waiter did not return")
	}
	expect(c, 2) // moved up behind a
	if got := q.Len(); got != 3 {
		t.Fatalf("Len = %d, want 3 (holder, a, c)", got)
	}
	select {
	case p := <-a.positions:
		t.Fatalf("a, ahead of the cancelled waiter, got position %d", p)
	default:
	}

	hold()
	releaseA := <-a.granted
	expect(c, 1)
	select {
	case <-c.granted:
		t.Fatal("c granted while a holds the key")
	default:
	}
	releaseA()
	(<-c.granted)()
	if q.Len() != 0 {
		t.Errorf("Len = %d, want 0", q.Len())
	}
	a.cancel()
	c.cancel()
}

func TestCancelledBeforeArrivalIsNotQueued(t *testing.T) {
	q := NewLine()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := q.Acquire(ctx, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	if q.Len() != 0 {
		t.Fatalf("Len = %d, want 0", q.Len())
	}
}

func TestReleaseOfOldHolderDoesNotReleaseNext(t *testing.T) {
	q := NewLine()
	r1, _ := q.Acquire(context.Background(), nil)
	got := make(chan func(), 1)
	go func() {
		r2, err := q.Acquire(context.Background(), nil)
		if err == nil {
			got <- r2
		}
	}()
	waitLen(t, q, 2)
	r1()
	r2 := <-got
	r1() // a stale second release must not free r2's hold
	if q.Len() != 1 {
		t.Fatalf("Len = %d, want 1 (r2 still holds)", q.Len())
	}
	r2()
}

func TestLinesAreIndependent(t *testing.T) {
	a, b := NewLine(), NewLine()
	ra, _ := a.Acquire(context.Background(), nil)
	defer ra()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	rb, err := b.Acquire(ctx, func(int) { t.Error("b waited behind a") })
	if err != nil {
		t.Fatalf("line b blocked by line a: %v", err)
	}
	rb()
}

func TestGrantedWhileCancelledPassesTheLineOn(t *testing.T) {
	q := NewLine()
	for range 200 {
		hold, _ := q.Acquire(context.Background(), nil)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			if release, err := q.Acquire(ctx, nil); err == nil {
				release()
			}
		}()
		waitLen(t, q, 2)
		held := make(chan struct{})
		go func() { hold(); close(held) }() // race the grant against the cancel
		cancel()
		<-done
		<-held
		if n := q.Len(); n != 0 {
			t.Fatalf("Len = %d after both left, want 0 (key leaked)", n)
		}
	}
}

// A burst of releases costs the waiters nothing: they are not woken to be
// told they moved up (that was n wake-ups and n progress frames per exec
// with n waiting); each looks at its place only every PositionEvery.
func TestReleasesDoNotReportToEveryWaiter(t *testing.T) {
	q := NewLine()
	q.every = time.Hour // no look during the test: only the first report
	hold, err := q.Acquire(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	const n = 20
	var reports [n]atomic.Int32
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			release, err := q.Acquire(context.Background(), func(int) { reports[i].Add(1) })
			if err != nil {
				t.Error(err)
				return
			}
			release()
		}()
		waitLen(t, q, i+2)
	}
	hold()
	wg.Wait()
	for i := range n {
		if got := reports[i].Load(); got != 1 {
			t.Errorf("waiter %d: %d position reports through %d releases, want 1 (on arrival)", i, got, i)
		}
	}
}

package events

import (
	"context"
	"encoding/json"
	"errors"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/backend"
)

var _ backend.EventSource = (*Bus)(nil)

const waitLimit = 10 * time.Second

func seqp(v uint64) *uint64 { return &v }

// next receives one event or fails the test after a generous timeout.
func next(t *testing.T, sub backend.EventSubscription) ipc.Event {
	t.Helper()
	select {
	case ev, ok := <-sub.Events():
		if !ok {
			t.Fatalf("event channel closed early; Err() = %v", sub.Err())
		}
		return ev
	case <-time.After(waitLimit):
		t.Fatal("timed out waiting for an event")
	}
	return ipc.Event{}
}

// waitClosed drains sub until its channel is closed and returns what it read.
func waitClosed(t *testing.T, sub backend.EventSubscription) []ipc.Event {
	t.Helper()
	var got []ipc.Event
	deadline := time.After(waitLimit)
	for {
		select {
		case ev, ok := <-sub.Events():
			if !ok {
				return got
			}
			got = append(got, ev)
		case <-deadline:
			t.Fatalf("timed out waiting for the subscription to end (read %d events)", len(got))
		}
	}
}

func assertNoEvent(t *testing.T, sub backend.EventSubscription) {
	t.Helper()
	select {
	case ev, ok := <-sub.Events():
		t.Fatalf("unexpected event %+v (open=%v)", ev, ok)
	default:
	}
}

func TestPublishOrderSeqAndData(t *testing.T) {
	clock := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	bus := NewBus(Options{Now: func() time.Time { return clock }})
	if got := bus.LastSeq(); got != 0 {
		t.Fatalf("LastSeq before any event = %d, want 0", got)
	}
	sub, err := bus.Subscribe(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()

	first := bus.Publish(ExecFinished, "s1", "run1", map[string]int{"exitCode": 7})
	bus.Publish(SessionReady, "s1", "run1", nil)
	bus.Publish(ConfigDrift, "s2", "", json.RawMessage(`{"configFile":"/x"}`))
	if first.Seq != 1 || bus.LastSeq() != 3 {
		t.Fatalf("seqs: first=%d last=%d, want 1 and 3", first.Seq, bus.LastSeq())
	}

	ev := next(t, sub)
	if ev.Seq != 1 || ev.Type != ExecFinished || ev.SessionID != "s1" || ev.RunID != "run1" || !ev.Time.Equal(clock) {
		t.Fatalf("first event = %+v", ev)
	}
	var data struct{ ExitCode int }
	if err := json.Unmarshal(ev.Data, &data); err != nil || data.ExitCode != 7 {
		t.Fatalf("data = %s (%v)", ev.Data, err)
	}
	if ev := next(t, sub); ev.Seq != 2 || ev.Data != nil {
		t.Fatalf("second event = %+v, want seq 2 without data", ev)
	}
	if ev := next(t, sub); ev.Seq != 3 || string(ev.Data) != `{"configFile":"/x"}` {
		t.Fatalf("third event = %+v", ev)
	}
	assertNoEvent(t, sub)
}

func TestUnencodableDataStillPublished(t *testing.T) {
	bus := NewBus(Options{})
	ev := bus.Publish(ExecStarted, "s", "r", make(chan int))
	var body struct{ Error string }
	if err := json.Unmarshal(ev.Data, &body); err != nil || body.Error == "" {
		t.Fatalf("data = %s (%v), want an error description", ev.Data, err)
	}
	if bus.LastSeq() != 1 {
		t.Fatalf("LastSeq = %d, want 1", bus.LastSeq())
	}
}

func TestSubscribeLiveOnlyWithoutSince(t *testing.T) {
	bus := NewBus(Options{})
	bus.Publish(SessionCreated, "a", "", nil)
	sub, err := bus.Subscribe(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	assertNoEvent(t, sub)
	bus.Publish(SessionReady, "a", "", nil)
	if ev := next(t, sub); ev.Seq != 2 {
		t.Fatalf("got seq %d, want 2 (live only)", ev.Seq)
	}
}

func TestSinceReplayThenLiveWithoutGapOrDuplicate(t *testing.T) {
	bus := NewBus(Options{BufferSize: 4096, SubscriberBuffer: 4096})
	for range 50 {
		bus.Publish(ExecQueued, "s", "", nil)
	}
	// Publishing continues while the subscriber joins: the cut between
	// replay and live must lose nothing and repeat nothing.
	const total = 2000
	done := make(chan struct{})
	go func() {
		defer close(done)
		for bus.LastSeq() < total {
			bus.Publish(ExecStarted, "s", "", nil)
		}
	}()
	sub, err := bus.Subscribe(t.Context(), seqp(20))
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	<-done
	for want := uint64(21); want <= total; want++ {
		if ev := next(t, sub); ev.Seq != want {
			t.Fatalf("got seq %d, want %d", ev.Seq, want)
		}
	}
	assertNoEvent(t, sub)

	// since == last: nothing replayed, live continues.
	sub2, err := bus.Subscribe(t.Context(), seqp(bus.LastSeq()))
	if err != nil {
		t.Fatal(err)
	}
	defer sub2.Close()
	assertNoEvent(t, sub2)
	bus.Publish(ExecFinished, "s", "", nil)
	if ev := next(t, sub2); ev.Seq != total+1 {
		t.Fatalf("got seq %d, want %d", ev.Seq, total+1)
	}
}

func gapOf(t *testing.T, ev ipc.Event) GapData {
	t.Helper()
	if ev.Type != StreamGap {
		t.Fatalf("event %+v, want %s", ev, StreamGap)
	}
	var g GapData
	if err := json.Unmarshal(ev.Data, &g); err != nil {
		t.Fatalf("gap data %s: %v", ev.Data, err)
	}
	return g
}

func TestSinceOlderThanBufferReportsGap(t *testing.T) {
	bus := NewBus(Options{BufferSize: 4})
	for range 10 {
		bus.Publish(ExecQueued, "s", "", nil)
	}
	sub, err := bus.Subscribe(t.Context(), seqp(2))
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	gapEv := next(t, sub)
	g := gapOf(t, gapEv)
	if g.Since != 2 || g.FirstLost != 3 || g.LastLost != 6 || g.Reason == "" {
		t.Fatalf("gap = %+v, want since 2, lost 3..6", g)
	}
	if gapEv.Seq != 0 {
		t.Fatalf("gap seq = %d, want 0 (not part of the sequence)", gapEv.Seq)
	}
	for want := uint64(7); want <= 10; want++ {
		if ev := next(t, sub); ev.Seq != want || ev.Type != ExecQueued {
			t.Fatalf("got %+v, want seq %d", ev, want)
		}
	}
	assertNoEvent(t, sub)

	// since=0 on a full buffer: events 1..6 are gone.
	sub0, err := bus.Subscribe(t.Context(), seqp(0))
	if err != nil {
		t.Fatal(err)
	}
	defer sub0.Close()
	if g := gapOf(t, next(t, sub0)); g.FirstLost != 1 || g.LastLost != 6 {
		t.Fatalf("gap = %+v, want lost 1..6", g)
	}
}

func TestSinceAheadOfSequenceAfterRestart(t *testing.T) {
	bus := NewBus(Options{})
	bus.Publish(SessionAdopted, "a", "", nil)
	bus.Publish(SessionAdopted, "b", "", nil)
	// A client resuming from a previous daemon's seq 500.
	sub, err := bus.Subscribe(t.Context(), seqp(500))
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	g := gapOf(t, next(t, sub))
	if g.Since != 500 || g.FirstLost != 0 || g.LastLost != 0 || g.Reason == "" {
		t.Fatalf("gap = %+v, want since 500 with nothing of this daemon lost", g)
	}
	if a, b := next(t, sub), next(t, sub); a.Seq != 1 || b.Seq != 2 {
		t.Fatalf("replay seqs %d,%d, want 1,2", a.Seq, b.Seq)
	}
}

func TestSlowConsumerCutOffWhilePublishingContinues(t *testing.T) {
	bus := NewBus(Options{SubscriberBuffer: 4})
	slow, err := bus.Subscribe(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	fast, err := bus.Subscribe(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer fast.Close()

	// The fast subscriber acknowledges each event and the publisher waits
	// for that acknowledgement, so only the slow one can fall behind.
	const total = 100
	acks := make(chan uint64)
	go func() {
		for ev := range fast.Events() {
			acks <- ev.Seq
		}
		close(acks)
	}()
	for i := range total {
		published := make(chan struct{})
		go func() {
			defer close(published)
			bus.Publish(ExecStarted, "s", "", nil)
		}()
		select {
		case <-published: // Publish never waits for the slow subscriber
		case <-time.After(waitLimit):
			t.Fatal("Publish blocked on a subscriber that does not read")
		}
		select {
		case seq, ok := <-acks:
			if !ok || seq != uint64(i+1) {
				t.Fatalf("fast subscriber got seq %d (open=%v), want %d; Err() = %v", seq, ok, i+1, fast.Err())
			}
		case <-time.After(waitLimit):
			t.Fatal("fast subscriber did not receive the event")
		}
	}

	got := waitClosed(t, slow)
	if len(got) != 5 {
		t.Fatalf("slow subscriber got %d events, want 4 then stream.closed: %+v", len(got), got)
	}
	for i := range 4 {
		if got[i].Seq != uint64(i+1) {
			t.Fatalf("slow event %d has seq %d", i, got[i].Seq)
		}
	}
	last := got[4]
	var cd ipc.StreamClosed
	if err := json.Unmarshal(last.Data, &cd); last.Type != StreamClosed || err != nil || last.Seq != 0 ||
		!strings.HasPrefix(cd.Reason, ReasonSlowConsumer) || !strings.Contains(cd.Reason, "?since=4") || cd.Code != string(errdefs.KindUnavailable) {
		t.Fatalf("final event %+v (%+v), want stream.closed slow consumer resuming after seq 4", last, cd)
	}
	if err := slow.Err(); !errors.Is(err, ErrSlowConsumer) || !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("Err() = %v, want ErrSlowConsumer", err)
	}
	if n := bus.Subscribers(); n != 1 {
		t.Fatalf("Subscribers() = %d, want 1 (the fast one)", n)
	}
}

func TestContextCancelUnsubscribes(t *testing.T) {
	bus := NewBus(Options{})
	ctx, cancel := context.WithCancel(t.Context())
	sub, err := bus.Subscribe(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if bus.Subscribers() != 1 {
		t.Fatalf("Subscribers() = %d, want 1", bus.Subscribers())
	}
	cancel()
	if got := waitClosed(t, sub); len(got) != 0 {
		t.Fatalf("got %+v after cancel, want nothing", got)
	}
	if err := sub.Err(); !errors.Is(err, context.Canceled) || !errors.Is(err, errdefs.ErrCanceled) {
		t.Fatalf("Err() = %v, want canceled", err)
	}
	if bus.Subscribers() != 0 {
		t.Fatalf("Subscribers() = %d after cancel, want 0", bus.Subscribers())
	}
	bus.Publish(SessionReady, "", "", nil) // must not send on the closed channel
	sub.Close()                            // idempotent after the end

	if _, err := bus.Subscribe(ctx, nil); !errors.Is(err, errdefs.ErrCanceled) {
		t.Fatalf("Subscribe with a done context: %v, want canceled", err)
	}
}

func TestCloseSubscription(t *testing.T) {
	bus := NewBus(Options{})
	sub, err := bus.Subscribe(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	bus.Publish(SessionReady, "", "", nil)
	sub.Close()
	sub.Close()
	got := waitClosed(t, sub)
	if len(got) != 1 || got[0].Seq != 1 {
		t.Fatalf("events after Close = %+v, want the one already buffered", got)
	}
	if err := sub.Err(); err != nil {
		t.Fatalf("Err() after Close = %v, want nil", err)
	}
	if bus.Subscribers() != 0 {
		t.Fatalf("Subscribers() = %d, want 0", bus.Subscribers())
	}
}

func TestBusCloseEndsStreams(t *testing.T) {
	bus := NewBus(Options{})
	sub, err := bus.Subscribe(t.Context(), nil)
	if err != nil {
		t.Fatal(err)
	}
	bus.Close()
	got := waitClosed(t, sub)
	var cd ipc.StreamClosed
	if len(got) != 1 || got[0].Type != StreamClosed || json.Unmarshal(got[0].Data, &cd) != nil || !strings.HasPrefix(cd.Reason, ReasonShutdown) {
		t.Fatalf("got %+v, want one stream.closed (shutdown)", got)
	}
	if !errors.Is(sub.Err(), ErrBusClosed) {
		t.Fatalf("Err() = %v, want ErrBusClosed", sub.Err())
	}
	if _, err := bus.Subscribe(t.Context(), nil); !errors.Is(err, ErrBusClosed) {
		t.Fatalf("Subscribe after Close: %v, want ErrBusClosed", err)
	}
}

func TestConcurrentPublishersAndSubscribers(t *testing.T) {
	bus := NewBus(Options{BufferSize: 64, SubscriberBuffer: 8192})
	const publishers, perPublisher, subscribers = 4, 500, 4
	var subWG sync.WaitGroup
	errs := make(chan error, subscribers)
	for range subscribers {
		sub, err := bus.Subscribe(t.Context(), seqp(0))
		if err != nil {
			t.Fatal(err)
		}
		subWG.Add(1)
		go func() {
			defer subWG.Done()
			defer sub.Close()
			var want uint64 = 1
			for ev := range sub.Events() {
				if ev.Seq != want {
					errs <- errors.New("out of order")
					return
				}
				if want == publishers*perPublisher {
					return
				}
				want++
			}
			errs <- sub.Err()
		}()
	}
	var pubWG sync.WaitGroup
	for range publishers {
		pubWG.Add(1)
		go func() {
			defer pubWG.Done()
			for range perPublisher {
				bus.Publish(ExecStarted, "", "", nil)
			}
		}()
	}
	pubWG.Wait()
	subWG.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("subscriber: %v", err)
	}
}

func TestNoGoroutineLeak(t *testing.T) {
	bus := NewBus(Options{SubscriberBuffer: 2})
	before := runtime.NumGoroutine()
	for i := range 200 {
		ctx, cancel := context.WithCancel(t.Context())
		sub, err := bus.Subscribe(ctx, seqp(0))
		if err != nil {
			t.Fatal(err)
		}
		switch i % 3 {
		case 0:
			cancel()
		case 1:
			sub.Close()
		case 2:
			for range 4 { // overflow: cut off as a slow consumer
				bus.Publish(ExecQueued, "", "", nil)
			}
		}
		waitClosed(t, sub)
		cancel()
	}
	deadline := time.Now().Add(waitLimit)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		runtime.Gosched()
		time.Sleep(time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before {
		t.Fatalf("%d goroutines after all subscriptions ended, %d before", n, before)
	}
	if bus.Subscribers() != 0 {
		t.Fatalf("Subscribers() = %d, want 0", bus.Subscribers())
	}
}

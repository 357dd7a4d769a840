// Package events is the daemon's in-memory event bus: every event gets the
// next sequence number, the most recent ones are kept in a bounded replay
// buffer so that a client can resume a stream (GET /v1/events?since=SEQ),
// and live subscribers receive events without ever slowing the publisher.
package events

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/backend"
)

// Event is the wire event (ipc.Event).
type Event = ipc.Event

// Event types published by the daemon.
const (
	SessionCreated  = "session.created"
	SessionReady    = "session.ready"
	SessionProgress = "session.progress" // a phase of a sandbox's start (ipc.Progress)
	SessionExpired  = "session.expired"
	SessionStopped  = "session.stopped"
	SessionAdopted  = "session.adopted"
	// SessionAdoptionRefused says that a run named in the RWX CLI's file
	// was not adopted, and why (the remote did not confirm it).
	SessionAdoptionRefused = "session.adoption_refused"
	SessionPruned          = "session.pruned"
	// SessionIdleWarning announces the idle stop of a sandbox about a
	// minute ahead (ipc.IdleWarning).
	SessionIdleWarning = "session.idle_warning"
	// SessionExpiring says that a sandbox's edits were pulled (or could
	// not be) ahead of the end its remote reports (ipc.Expiring).
	SessionExpiring = "session.expiring"
	ExecQueued      = "exec.queued"
	ExecStarted     = "exec.started"
	ExecFinished    = "exec.finished"
	SyncPushed      = "sync.pushed"
	ConnectionUp    = "connection.up"
	ConnectionDown  = "connection.down"
	// SandboxState is a change of a sandbox controller's state
	// (connecting, ready, leased, reconnecting, ended), with the one it
	// left and why.
	SandboxState      = "sandbox.state"
	ReconcileFinished = "reconcile.finished"
	ConfigDrift       = "config.drift"
	BranchChanged     = "branch.changed"
	BackgroundStarted = "background.started"
	BackgroundStopped = "background.stopped"
	ForwardOpened     = "forward.opened"
	ForwardClosed     = "forward.closed"
	ForwardFailed     = "forward.failed"
	// HelperFallback says, once per run, that synced execs there go
	// without the sandbox helper, and why (data: reason).
	HelperFallback = "helper.fallback"

	// StreamGap and StreamClosed are synthesized per subscription, never
	// published: they describe that subscriber's stream, not the daemon, and
	// are not part of the sequence (Seq 0).
	StreamGap    = "stream.gap"
	StreamClosed = ipc.EventStreamClosed
)

// Defaults of Options.
const (
	DefaultBufferSize       = 1024
	DefaultSubscriberBuffer = 256
)

// Reasons that start the Reason of a stream.closed event's data
// (ipc.StreamClosed).
const (
	ReasonSlowConsumer = "slow consumer"
	ReasonShutdown     = "daemon shutting down"
)

// Errors a subscription ends with (Subscription.Err). Callers branch on them
// with errors.Is; both carry the errdefs kind the socket API reports.
var (
	// ErrSlowConsumer: the subscriber did not read fast enough and was
	// disconnected so that it could not hold up the daemon.
	ErrSlowConsumer = errdefs.Unavailable(errors.New("event stream closed: the client did not keep up; reconnect with ?since=<last seq> to resume"))
	// ErrBusClosed: the daemon is shutting down.
	ErrBusClosed = errdefs.Unavailable(errors.New("event stream closed: sandboxd is shutting down"))
)

// Options configure a Bus. Zero values select the defaults.
type Options struct {
	// BufferSize is how many recent events are kept for replay (default 1024).
	BufferSize int
	// SubscriberBuffer is how many live events may wait unread for one
	// subscriber before it is disconnected (default 256).
	SubscriberBuffer int
	Now              func() time.Time
	Logger           *slog.Logger
}

// Bus is the event bus. It is safe for concurrent use.
type Bus struct {
	subBuffer int
	now       func() time.Time
	log       *slog.Logger

	mu     sync.Mutex
	seq    uint64      // last assigned sequence number
	ring   []ipc.Event // replay buffer; ring[(seq-1)%len(ring)] holds seq
	held   int         // how many events ring holds
	subs   map[*subscription]struct{}
	closed bool
}

// NewBus returns an empty bus; the first event gets Seq 1.
func NewBus(opts Options) *Bus {
	if opts.BufferSize <= 0 {
		opts.BufferSize = DefaultBufferSize
	}
	if opts.SubscriberBuffer <= 0 {
		opts.SubscriberBuffer = DefaultSubscriberBuffer
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	return &Bus{
		subBuffer: opts.SubscriberBuffer,
		now:       opts.Now,
		log:       opts.Logger,
		ring:      make([]ipc.Event, opts.BufferSize),
		subs:      make(map[*subscription]struct{}),
	}
}

// Publish records an event and hands it to every subscriber. It never
// blocks on subscribers: one whose buffer is full is disconnected instead.
// data is marshalled to JSON (nil means no data).
func (b *Bus) Publish(typ, sessionID, runID string, data any) ipc.Event {
	raw := b.marshal(typ, data)
	b.mu.Lock()
	defer b.mu.Unlock()
	b.seq++
	ev := ipc.Event{Seq: b.seq, Time: b.now(), Type: typ, SessionID: sessionID, RunID: runID, Data: raw}
	b.ring[(ev.Seq-1)%uint64(len(b.ring))] = ev
	if b.held < len(b.ring) {
		b.held++
	}
	for s := range b.subs {
		// One slot is reserved for the final stream.closed event.
		if len(s.ch) >= cap(s.ch)-1 {
			b.endLocked(s, ReasonSlowConsumer, ErrSlowConsumer)
			b.log.Warn("event subscriber disconnected: it stopped reading", "lastSeq", s.lastSeq, "buffer", cap(s.ch)-1)
			continue
		}
		s.ch <- ev
		s.lastSeq = ev.Seq
	}
	return ev
}

func (b *Bus) marshal(typ string, data any) json.RawMessage {
	if data == nil {
		return nil
	}
	if raw, ok := data.(json.RawMessage); ok && json.Valid(raw) {
		return raw
	}
	raw, err := json.Marshal(data)
	if err != nil {
		// An event is never dropped for its payload; say what went wrong.
		b.log.Error("marshal event data", "type", typ, "err", err)
		raw, _ = json.Marshal(map[string]string{"error": fmt.Sprintf("event data could not be encoded: %v", err)})
	}
	return raw
}

// LastSeq is the sequence number of the newest event (0 before the first).
func (b *Bus) LastSeq() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.seq
}

// Subscribers is the number of live subscriptions.
func (b *Bus) Subscribers() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.subs)
}

// GapData is the Data of a stream.gap event: the requested resume point is
// no longer (or was never) in this daemon's replay buffer.
type GapData struct {
	// Since is the sequence number the client asked to resume after.
	Since uint64 `json:"since"`
	// FirstLost..LastLost are the events that can no longer be replayed
	// (both 0 when none of this daemon's events were lost).
	FirstLost uint64 `json:"firstLost,omitempty"`
	LastLost  uint64 `json:"lastLost,omitempty"`
	Reason    string `json:"reason"`
}

// Subscribe starts a subscription. With since == nil it receives only
// events published from now on; otherwise it first receives every held
// event with Seq > *since, then live events, with no gap or duplicate in
// between. If events after *since are no longer held (or *since is ahead of
// this daemon's sequence, as after a restart), the first event delivered is a
// stream.gap saying which events were lost. The subscription ends when ctx
// ends, when Close is called, or when the subscriber falls behind by more
// than its buffer (a final stream.closed event says so).
func (b *Bus) Subscribe(ctx context.Context, since *uint64) (backend.EventSubscription, error) {
	if err := ctx.Err(); err != nil {
		return nil, errdefs.Canceled(fmt.Errorf("subscribe to events: %w", err))
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, ErrBusClosed
	}
	var backlog []ipc.Event
	if since != nil {
		backlog = b.replayLocked(*since)
	}
	// The buffer holds the whole replay plus the live allowance, plus the
	// slot reserved for stream.closed.
	s := &subscription{bus: b, ch: make(chan ipc.Event, len(backlog)+b.subBuffer+1), lastSeq: b.seq}
	for _, ev := range backlog {
		s.ch <- ev
	}
	b.subs[s] = struct{}{}
	s.stopCtx = context.AfterFunc(ctx, func() {
		b.mu.Lock()
		defer b.mu.Unlock()
		b.endLocked(s, "", errdefs.Canceled(fmt.Errorf("event stream: %w", context.Cause(ctx))))
	})
	return s, nil
}

// replayLocked returns the events after since that a subscriber must get
// first, starting with a stream.gap when some are lost.
func (b *Bus) replayLocked(since uint64) []ipc.Event {
	oldest := b.seq - uint64(b.held) + 1 // first held seq (seq+1 when none)
	var out []ipc.Event
	switch {
	case since > b.seq:
		gap := GapData{Since: since, Reason: fmt.Sprintf("seq %d is ahead of this daemon's latest event %d: sandboxd restarted and its event sequence started over; replaying every event still held", since, b.seq)}
		if oldest > 1 {
			gap.FirstLost, gap.LastLost = 1, oldest-1
		}
		out = append(out, b.synthetic(StreamGap, gap))
		since = oldest - 1
	case since+1 < oldest:
		out = append(out, b.synthetic(StreamGap, GapData{
			Since: since, FirstLost: since + 1, LastLost: oldest - 1,
			Reason: fmt.Sprintf("events %d to %d are no longer in the replay buffer", since+1, oldest-1),
		}))
		since = oldest - 1
	}
	for seq := since + 1; seq <= b.seq; seq++ {
		out = append(out, b.ring[(seq-1)%uint64(len(b.ring))])
	}
	return out
}

func (b *Bus) synthetic(typ string, data any) ipc.Event {
	raw, _ := json.Marshal(data) // GapData and ipc.StreamClosed always encode
	return ipc.Event{Time: b.now(), Type: typ, Data: raw}
}

// endLocked ends subscription s: if reason is set, a final stream.closed
// event goes into the reserved slot; then its channel is closed and err
// recorded. Calling it on an ended subscription does nothing.
func (b *Bus) endLocked(s *subscription, reason string, err error) {
	if _, ok := b.subs[s]; !ok {
		return
	}
	delete(b.subs, s)
	if reason != "" && len(s.ch) < cap(s.ch) {
		s.ch <- b.synthetic(StreamClosed, ipc.StreamClosed{
			Code:   string(errdefs.KindOf(err)),
			Reason: fmt.Sprintf("%s: the stream ended after seq %d; reconnect with ?since=%d to resume", reason, s.lastSeq, s.lastSeq),
		})
	}
	s.err = err
	close(s.ch)
	if s.stopCtx != nil {
		s.stopCtx()
	}
}

// Close ends every subscription with a stream.closed event ("daemon shutting
// down") so that streaming responses finish and the server can shut down.
// Later Subscribe calls fail with ErrBusClosed; Publish keeps recording.
func (b *Bus) Close() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	for s := range b.subs {
		b.endLocked(s, ReasonShutdown, ErrBusClosed)
	}
}

// subscription implements backend.EventSubscription. Its fields are guarded by
// bus.mu; only the bus sends on ch, always without blocking.
type subscription struct {
	bus     *Bus
	ch      chan ipc.Event
	lastSeq uint64 // last event put into ch
	err     error
	stopCtx func() bool
}

func (s *subscription) Events() <-chan ipc.Event { return s.ch }

func (s *subscription) Err() error {
	s.bus.mu.Lock()
	defer s.bus.mu.Unlock()
	return s.err
}

func (s *subscription) Close() {
	s.bus.mu.Lock()
	defer s.bus.mu.Unlock()
	s.bus.endLocked(s, "", nil)
}

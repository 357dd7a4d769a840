package server

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// eventWriteTimeout bounds one event write: a client that stops reading for
// this long is cut off rather than holding a handler forever (the event bus
// has already dropped it by then).
const eventWriteTimeout = 30 * time.Second

// getEvents serves GET /v1/events: NDJSON, one Event per line, flushed. A
// stream the daemon ends gets a last "stream.closed" event saying why.
func (s *Server) getEvents(w http.ResponseWriter, r *http.Request) error {
	q := newQuery(r)
	since := q.uint64Ptr("since")
	if err := q.done(); err != nil {
		return err
	}
	if s.b.Events == nil {
		return errdefs.Unavailable(errors.New("events are not available: the daemon has not finished starting (or failed to); see `nook daemon status`"))
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	sub, err := s.b.Events.Subscribe(ctx, since)
	if err != nil {
		return err
	}
	defer sub.Close()
	defer s.trackStream()()

	rc := http.NewResponseController(w)
	w.Header().Set("Content-Type", ipc.ContentTypeNDJSON)
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(http.StatusOK)
	if err := rc.Flush(); err != nil {
		return nil // the client is gone; nothing to answer
	}
	send := func(ev ipc.Event) bool {
		b, err := json.Marshal(ev)
		if err != nil {
			s.log.Error("encode event", "type", ev.Type, "err", err)
			return true
		}
		_ = rc.SetWriteDeadline(time.Now().Add(eventWriteTimeout))
		if _, err := w.Write(append(b, '\n')); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	closed := func(err error) {
		data, _ := json.Marshal(ipc.StreamClosed{Code: string(kindOf(err)), Reason: err.Error()})
		send(ipc.Event{Time: time.Now().UTC(), Type: ipc.EventStreamClosed, Data: data})
	}
	for {
		select {
		case ev, ok := <-sub.Events():
			if ok && ev.Type == ipc.EventStreamClosed {
				// The source ended the stream with its own reason (a slow
				// consumer): forward it as the last event.
				send(ev)
				return nil
			}
			if !ok {
				if ctx.Err() != nil {
					return nil
				}
				err := sub.Err()
				if err == nil {
					err = errdefs.Unavailable(errors.New("the daemon ended the event stream: reconnect with ?since=<last seq> to resume"))
				}
				closed(err)
				return nil
			}
			if !send(ev) {
				return nil
			}
		case <-ctx.Done():
			return nil
		case <-s.closing:
			closed(errdefs.Unavailable(errors.New("the daemon is shutting down: reconnect with ?since=<last seq> once it is back")))
			return nil
		}
	}
}

package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// EventStream follows GET /v1/events.
type EventStream struct {
	ctx    context.Context
	cancel context.CancelFunc
	body   io.Closer
	dec    *json.Decoder
}

// Events follows the daemon's events after since (nil: only new ones) until
// ctx ends or Close.
func (c *Client) Events(ctx context.Context, since *uint64) (*EventStream, error) {
	ctx, cancel := context.WithCancel(ctx)
	resp, err := c.roundTrip(ctx, request{method: http.MethodGet, path: "/v1/events", query: sinceQuery(since)})
	if err != nil {
		cancel()
		return nil, err
	}
	return &EventStream{ctx: ctx, cancel: cancel, body: resp.Body, dec: json.NewDecoder(resp.Body)}, nil
}

// StreamClosedError is the reason the daemon gave for ending the stream (a
// "stream.closed" record). It is wrapped in an *errdefs.Error of its code.
type StreamClosedError struct{ Reason string }

func (e *StreamClosedError) Error() string { return "the daemon ended the event stream: " + e.Reason }

// Next returns the next event. When the daemon ends the stream it returns a
// kinded error wrapping a *StreamClosedError; after Close or the end of ctx
// it returns a Canceled error.
func (s *EventStream) Next() (ipc.Event, error) {
	var ev ipc.Event
	if err := s.dec.Decode(&ev); err != nil {
		if s.ctx.Err() != nil {
			return ipc.Event{}, errdefs.Canceled(fmt.Errorf("event stream closed: %w", s.ctx.Err()))
		}
		if errors.Is(err, io.EOF) {
			return ipc.Event{}, errdefs.Unavailable(errors.New("the event stream ended without a reason (did the daemon stop?)"))
		}
		return ipc.Event{}, errdefs.Unavailable(fmt.Errorf("read the event stream: %w", err))
	}
	if ev.Type == ipc.EventStreamClosed {
		var sc ipc.StreamClosed
		_ = json.Unmarshal(ev.Data, &sc)
		kind := errdefs.Kind(sc.Code)
		if !ipc.KnownKind(sc.Code) {
			kind = errdefs.KindUnavailable
		}
		return ipc.Event{}, &errdefs.Error{Kind: kind, Err: &StreamClosedError{Reason: sc.Reason}}
	}
	return ev, nil
}

// Close ends the stream.
func (s *EventStream) Close() error {
	s.cancel()
	return s.body.Close()
}

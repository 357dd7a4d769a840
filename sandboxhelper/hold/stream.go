package hold

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"sync"
	"syscall"
	"time"

	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// A streamed start: `hold start` asks the helper's server to run the
// command and stays on the server's socket, which carries the command's
// output and end to it and the caller's stdin and signals from it. The
// output never waits on the files, nor the end on the status file: the
// start's path makes one directory entry and starts no keeper. The files
// are still written, the output before it is sent, so an attach after a
// lost channel finds at least what was sent; the run lock is released
// only once the status is written. Signals go to the command's process
// group as an attach's do, not on the stream, where they could wait
// behind stdin the command does not read.
//
// Frames, both ways: helperproto's hold stream.
const (
	frameOut   = helperproto.HoldOut   // server → start: stdout bytes, already kept
	frameErr   = helperproto.HoldErr   // server → start: stderr bytes, already kept
	frameEnd   = helperproto.HoldEnd   // server → start: the command's status (JSON)
	frameIn    = helperproto.HoldIn    // start → server: stdin bytes
	frameInEnd = helperproto.HoldInEnd // start → server: the caller's stdin ended
)

// Bounds of the stream: one frame's payload, and what the server queues
// for a start that falls behind before it stops sending (the start then
// reads the rest from the files).
const (
	maxStreamFrame  = helperproto.MaxHoldFrame
	maxStreamQueued = 1 << 20
	maxEndFrame     = helperproto.MaxHoldEnd
)

var appendFrame = helperproto.AppendHoldFrame

// FrameSizeError is a frame whose length is past the bound.
type FrameSizeError = helperproto.HoldFrameSizeError

// readFrame reads one frame whose payload is at most max bytes into buf.
var readFrame = helperproto.ReadHoldFrame

// Stream is the server's side of a streamed start (SpawnStream, then
// Serve once the start was answered).
type Stream struct {
	mu       sync.Mutex
	queue    [][]byte // frames not yet sent
	queued   int
	dropped  bool // fell behind, or detached: nothing more is queued
	ended    bool // the end frame is queued
	wake     chan struct{}
	in       chan []byte   // stdin bytes, for the command's relay
	inEnd    chan struct{} // closed at the start's end frame
	inEndSet sync.Once
	exited   chan struct{} // closed when the command exited
}

// NewStream is a Stream to pass to SpawnStream.
func NewStream() *Stream {
	return &Stream{wake: make(chan struct{}, 1), in: make(chan []byte), inEnd: make(chan struct{}), exited: make(chan struct{})}
}

func (s *Stream) push(frame []byte, end bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dropped {
		return
	}
	if s.queued+len(frame) > maxStreamQueued {
		s.dropped, s.queue, s.queued = true, nil, 0
	} else {
		s.queue = append(s.queue, frame)
		s.queued += len(frame)
		s.ended = s.ended || end
	}
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// teeWriter sends what reached the command's kept stream w.
type teeWriter struct {
	w   io.Writer
	s   *Stream
	typ byte
}

func (t *teeWriter) Write(p []byte) (int, error) {
	n, err := t.w.Write(p)
	for b := p; len(b) > 0; {
		k := min(len(b), maxStreamFrame)
		t.s.push(appendFrame(nil, t.typ, b[:k]), false)
		b = b[k:]
	}
	return n, err
}

func (s *Stream) end(st status) {
	b, _ := json.Marshal(st)
	s.push(appendFrame(nil, frameEnd, b), true)
}

// Serve sends the command's output and end on c, and takes its stdin
// from r (c's reading side, past the answer), until the end is
// sent, c is lost, or ctx ends; the command goes on either way. A start
// that falls behind gets no more frames (c's writing side is closed) but
// still feeds the stdin.
func (s *Stream) Serve(ctx context.Context, c io.WriteCloser, r io.Reader) {
	gone := make(chan struct{})
	go func() {
		defer close(gone)
		s.readFrom(r)
	}()
	defer func() {
		s.mu.Lock()
		s.dropped, s.queue = true, nil
		s.mu.Unlock()
	}()
	for {
		s.mu.Lock()
		q, dropped, ended := s.queue, s.dropped, s.ended
		s.queue, s.queued = nil, 0
		s.mu.Unlock()
		for _, f := range q {
			if _, err := c.Write(f); err != nil {
				return
			}
		}
		if ended {
			return
		}
		if dropped {
			if cw, ok := c.(interface{ CloseWrite() error }); ok {
				_ = cw.CloseWrite()
			}
			select {
			case <-gone:
			case <-s.exited:
			case <-ctx.Done():
			}
			return
		}
		select {
		case <-s.wake:
		case <-gone:
			return
		case <-ctx.Done():
			return
		}
	}
}

// readFrom takes the start's frames: stdin to the command's relay, and
// its end. A malformed frame ends the reading, as a lost channel.
func (s *Stream) readFrom(r io.Reader) {
	buf := make([]byte, maxStreamFrame)
	for {
		typ, p, err := readFrame(r, buf, maxStreamFrame)
		if err != nil {
			return
		}
		switch typ {
		case frameIn:
			b := append([]byte(nil), p...)
			select {
			case s.in <- b:
			case <-s.exited:
				return
			}
		case frameInEnd:
			s.inEndSet.Do(func() { close(s.inEnd) })
		default:
			return
		}
	}
}

// streamed relays a streamed start on c (rd its reading side, past the
// answer): the command's output to stdout and stderr, the caller's stdin
// (in frames when framed) to the server, signals to the command. Should c end before
// the command's end, the rest comes from the files, from the offsets
// relayed, and the stdin goes to the FIFO.
func (h *Holder) streamed(ctx context.Context, id string, c io.WriteCloser, rd io.Reader, stdin io.Reader, framed bool, sigs <-chan syscall.Signal, stdout, stderr io.Writer) (int, error) {
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { _ = c.Close() })
	defer stop()
	sink := &streamSink{c: c, h: h, id: id, ctx: ctx}
	go sink.feed(stdin, framed)
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case sig := <-sigs:
				h.signalStarted(ctx, id, sig)
			}
		}
	}()
	var outN, errN int64
	buf := make([]byte, maxStreamFrame)
	for {
		typ, p, err := readFrame(rd, buf, maxStreamFrame)
		if err != nil {
			if ctx.Err() != nil {
				return 0, ctx.Err()
			}
			// Fell behind, or the server is gone: the files have the rest.
			return h.Attach(ctx, id, outN, errN, stdout, stderr)
		}
		switch typ {
		case frameOut:
			// A channel that takes no more ends this start, as an
			// attach's copy; the command goes on.
			n, err := stdout.Write(p)
			outN += int64(n)
			if err != nil {
				return 0, err
			}
		case frameErr:
			n, err := stderr.Write(p)
			errN += int64(n)
			if err != nil {
				return 0, err
			}
		case frameEnd:
			var st status
			if len(p) > maxEndFrame || json.Unmarshal(p, &st) != nil || st.ExitCode < 0 || st.ExitCode > 255 {
				return h.Attach(ctx, id, outN, errN, stdout, stderr)
			}
			return st.ExitCode, nil
		default:
			return h.Attach(ctx, id, outN, errN, stdout, stderr)
		}
	}
}

// streamSink sends the caller's stdin on the stream, and once the stream
// fails, to the exec's FIFO.
type streamSink struct {
	mu     sync.Mutex
	c      io.Writer
	failed bool
	h      *Holder
	id     string
	ctx    context.Context
}

func (s *streamSink) send(typ byte, p []byte) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.failed {
		return false
	}
	if _, err := s.c.Write(appendFrame(nil, typ, p)); err != nil {
		s.failed = true
	}
	return !s.failed
}

func (s *streamSink) chunk(p []byte) {
	for len(p) > 0 {
		k := min(len(p), maxStreamFrame)
		if !s.send(frameIn, p[:k]) {
			_ = s.h.Feed(s.ctx, s.id, bytes.NewReader(p))
			return
		}
		p = p[k:]
	}
}

func (s *streamSink) end() {
	if !s.send(frameInEnd, nil) {
		_ = s.h.EOF(s.id)
	}
}

// feed reads the caller's stdin: in frames (the empty one is its end),
// or raw (whose end is no end of the input, as Feed's).
func (s *streamSink) feed(r io.Reader, framed bool) {
	buf := make([]byte, maxStreamFrame)
	if !framed {
		for {
			n, err := r.Read(buf)
			s.chunk(buf[:n])
			if err != nil || s.ctx.Err() != nil {
				return
			}
		}
	}
	var hdr [4]byte
	for {
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return
		}
		n := int(binary.BigEndian.Uint32(hdr[:]))
		if n == 0 {
			s.end()
			return
		}
		if n > maxFrame {
			return
		}
		for n > 0 {
			m, err := io.ReadFull(r, buf[:min(n, len(buf))])
			s.chunk(buf[:m])
			if err != nil || s.ctx.Err() != nil {
				return
			}
			n -= m
		}
	}
}

// signalStarted is Signal, waiting up to signalWait for the command's
// process to be recorded (the server records it beside the command's
// start, not before its answer).
func (h *Holder) signalStarted(ctx context.Context, id string, sig syscall.Signal) {
	deadline := time.Now().Add(signalWait)
	for {
		err := h.Signal(id, sig)
		if !errors.Is(err, ErrUnknown) || time.Now().After(deadline) {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(pollEvery):
		}
	}
}

// signalWait bounds the wait of a signal for the command's process.
const signalWait = 2 * time.Second

// Package delayline adds a fixed one-way delay to every byte of a
// connection, in user space (there is no kernel traffic shaping here), so
// that localcloud can behave like a remote at a given round-trip time.
//
// It is a delay line, not a per-write sleep: each chunk is stamped when it
// is written (or arrives) and handed on D later, while later chunks are
// already on their way, so throughput is kept and only latency grows.
// Wrapping the server side of a connection delays both directions, so the
// round trip grows by 2*D.
package delayline

import (
	"errors"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// queueChunks bounds the chunks in flight each way: beyond it a writer
// waits (backpressure) instead of buffering without end.
const queueChunks = 1024

// Listener wraps ln so that every accepted connection is delayed by d()
// each way; d is asked for each chunk, so the delay can change while
// connections live (a zero delay still passes through the line).
func Listener(ln net.Listener, d func() time.Duration) net.Listener {
	return ListenerWith(ln, Options{Delay: d})
}

// Fixed returns a delay function of constant d.
func Fixed(d time.Duration) func() time.Duration { return func() time.Duration { return d } }

type listener struct {
	net.Listener
	d       func() time.Duration
	silence func() Silence
}

func (l *listener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return newConn(c, l.d, l.silence), nil
}

// Conn wraps c so that what it reads and what it writes are each delayed by
// d().
func Conn(c net.Conn, d func() time.Duration) net.Conn {
	return newConn(c, d, nil)
}

func newConn(c net.Conn, d func() time.Duration, silence func() Silence) net.Conn {
	dc := &conn{
		Conn:     c,
		d:        d,
		silence:  silence,
		born:     time.Now(),
		in:       make(chan chunk, queueChunks),
		out:      make(chan chunk, queueChunks),
		closed:   make(chan struct{}),
		readDone: make(chan struct{}),
		deadline: make(chan struct{}),
	}
	go dc.readLoop()
	go dc.writeLoop()
	return dc
}

type chunk struct {
	b   []byte
	due time.Time
	err error // the read error that ended the stream (delayed like data)
}

type conn struct {
	net.Conn
	d func() time.Duration

	silence  func() Silence
	born     time.Time
	exempt   atomic.Bool
	dropped  [3]atomic.Bool // by Direction: lost for good
	readDone chan struct{}  // closed when readLoop returns

	in  chan chunk // arrived from the peer, not yet due
	out chan chunk // written by us, not yet sent

	readMu  sync.Mutex // one reader at a time
	head    *chunk     // taken from in but not yet due when a deadline hit
	pending []byte     // due data a short Read left
	readErr error      // sticky end of stream

	mu        sync.Mutex
	rdeadline time.Time
	deadline  chan struct{} // closed and replaced when the read deadline changes
	writeErr  error
	closing   bool
	closeOnce sync.Once
	closed    chan struct{}
}

// readLoop reads the peer's bytes as they arrive and stamps them.
func (c *conn) readLoop() {
	defer close(c.readDone)
	for {
		buf := make([]byte, 32<<10)
		n, err := c.Conn.Read(buf)
		if c.gate(Up) {
			if err != nil {
				return
			}
			continue // lost in the silence, the end of stream too
		}
		now := time.Now()
		if n > 0 {
			select {
			case c.in <- chunk{b: buf[:n], due: now.Add(c.d())}:
			case <-c.closed:
				return
			}
		}
		if err != nil {
			select {
			case c.in <- chunk{err: err, due: now.Add(c.d())}:
			case <-c.closed:
			}
			return
		}
	}
}

// writeLoop sends each written chunk once it is due; after Close it still
// delivers what was written before (a response followed by a close must
// arrive whole), then closes the connection.
func (c *conn) writeLoop() {
	defer func() {
		// A silence holds the close like any byte; one for good keeps the
		// socket until the client gives up on it.
		if c.gate(Down) {
			select {
			case <-c.readDone:
			case <-time.After(dropLinger):
			}
		}
		c.Conn.Close()
	}()
	for {
		var ch chunk
		select {
		case ch = <-c.out:
		case <-c.closed:
			select {
			case ch = <-c.out: // written before Close: still delivered
			default:
				return
			}
		}
		if wait := time.Until(ch.due); wait > 0 {
			time.Sleep(wait)
		}
		if c.failed() != nil || c.gate(Down) {
			continue // drain: writers must not block on a dead connection
		}
		_ = c.Conn.SetWriteDeadline(time.Now().Add(30 * time.Second))
		if _, err := c.Conn.Write(ch.b); err != nil {
			c.mu.Lock()
			if c.writeErr == nil {
				c.writeErr = err
			}
			c.mu.Unlock()
		}
	}
}

func (c *conn) failed() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.writeErr
}

func (c *conn) Write(p []byte) (int, error) {
	c.mu.Lock()
	closing, err := c.closing, c.writeErr
	c.mu.Unlock()
	if closing {
		return 0, net.ErrClosed
	}
	if err != nil {
		return 0, err
	}
	b := make([]byte, len(p))
	copy(b, p)
	select {
	case c.out <- chunk{b: b, due: time.Now().Add(c.d())}:
		return len(p), nil
	case <-c.closed:
		return 0, net.ErrClosed
	}
}

func (c *conn) Read(p []byte) (int, error) {
	c.readMu.Lock()
	defer c.readMu.Unlock()
	if len(c.pending) > 0 {
		n := copy(p, c.pending)
		c.pending = c.pending[n:]
		return n, nil
	}
	if c.readErr != nil {
		return 0, c.readErr
	}
	for {
		n, err := c.readOnce(p)
		if errors.Is(err, errDeadlineChanged) {
			continue
		}
		return n, err
	}
}

// errDeadlineChanged makes Read start over with the new deadline.
var errDeadlineChanged = errors.New("read deadline changed")

func (c *conn) readOnce(p []byte) (int, error) {
	c.mu.Lock()
	dl, changed := c.rdeadline, c.deadline
	c.mu.Unlock()
	var timeout <-chan time.Time
	if !dl.IsZero() {
		wait := time.Until(dl)
		if wait <= 0 {
			return 0, os.ErrDeadlineExceeded
		}
		t := time.NewTimer(wait)
		defer t.Stop()
		timeout = t.C
	}
	if c.head == nil {
		select {
		case ch := <-c.in:
			c.head = &ch
		case <-timeout:
			return 0, os.ErrDeadlineExceeded
		case <-changed:
			return 0, errDeadlineChanged
		case <-c.closed:
			return 0, net.ErrClosed
		}
	}
	// The chunk stays at the head until it is due, across deadlines.
	if wait := time.Until(c.head.due); wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-t.C:
		case <-timeout:
			return 0, os.ErrDeadlineExceeded
		case <-changed:
			return 0, errDeadlineChanged
		case <-c.closed:
			return 0, net.ErrClosed
		}
	}
	ch := *c.head
	c.head = nil
	if ch.err != nil {
		c.readErr = ch.err
		return 0, c.readErr
	}
	n := copy(p, ch.b)
	c.pending = ch.b[n:]
	return n, nil
}

func (c *conn) SetDeadline(t time.Time) error {
	if err := c.SetReadDeadline(t); err != nil {
		return err
	}
	return c.SetWriteDeadline(t)
}

// SetReadDeadline applies to the delayed stream (net/http aborts its
// background read with a deadline in the past).
func (c *conn) SetReadDeadline(t time.Time) error {
	c.mu.Lock()
	c.rdeadline = t
	close(c.deadline)
	c.deadline = make(chan struct{})
	c.mu.Unlock()
	return nil
}

// SetWriteDeadline is accepted and ignored: writes return at once (they are
// queued), so there is nothing to bound.
func (c *conn) SetWriteDeadline(time.Time) error { return nil }

// Close stops reading at once; what was written before is still delivered
// when due, then the connection closes.
func (c *conn) Close() error {
	c.closeOnce.Do(func() {
		c.mu.Lock()
		c.closing = true
		c.mu.Unlock()
		close(c.closed)
	})
	return nil
}

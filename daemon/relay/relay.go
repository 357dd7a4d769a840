// Package relay is the daemon's side of the sandbox helper's relay
// (docs/durable-exec.md, "The relay"): one long-lived `hold relay`
// channel per kept connection that starts and relays each held exec in
// turn, and runs held synced execs' exchanges in its own process, so that
// neither costs an exec request, channel or process of its own. A Slot is
// one sandbox controller's relay; an exec uses it when it is up and idle,
// else an exec request of its own. Every frame the relay sends is the
// sandbox's word, and is checked.
package relay

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/internal/helperproto"
	"golang.org/x/crypto/ssh"
)

// DefaultIdle is how long a relay stays open after its last exec. An open
// channel keeps localcloud's agent busy (no idle stop while it is open),
// so this stays far below any agent's idle deadline.
const DefaultIdle = 30 * time.Second

// killGrace is how long a held command whose caller went away gets after
// TERM before KILL, and after KILL before the relay is given up.
const killGrace = 2 * time.Second

// stdinEnd is how long an exec that ended waits for its stdin writer to
// end before it leaves the relay busy until then: the next exec finds it
// idle.
const stdinEnd = 100 * time.Millisecond

// readyWait bounds an exec's wait for the ready frame of a relay opened
// for it: a helper's start, with room for a loaded sandbox.
const readyWait = 10 * time.Second

// CloseGrace is how long a relay asked to close (its stdin ended) gets to
// end before its channel is cut.
const CloseGrace = 5 * time.Second

var (
	// ErrNotSent: the request never reached the relay; nothing ran.
	ErrNotSent = errors.New("the relay did not take the request")
	// ErrLost: the relay's channel ended while the command ran, its
	// connection fine (the relay was killed): the command is attached to.
	ErrLost = errors.New("the sandbox helper's relay ended while the command ran")
	// errClosed: the relay was closed by this side.
	errClosed = errors.New("the relay was closed")
	// ErrForged: the relay answered something no relay sends.
	ErrForged = errors.New("the sandbox helper's relay answered a malformed frame")
)

// Slot is the relay of one sandbox: at most one open, on the connection
// that holds the lock, and the connection and helper that refused one.
type Slot struct {
	log    *slog.Logger
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	// readyWait is readyWait, shorter in tests.
	readyWait time.Duration

	mu      sync.Mutex
	closed  bool
	cur     *Relay
	refused struct {
		conn *sshpool.Conn
		bin  string
	}
}

// NewSlot returns an empty slot; Close ends it.
func NewSlot(log *slog.Logger) *Slot {
	ctx, cancel := context.WithCancel(context.Background())
	return &Slot{log: log, ctx: ctx, cancel: cancel, readyWait: readyWait}
}

// Relay is one `hold relay` channel.
type Relay struct {
	log       *slog.Logger
	conn      *sshpool.Conn
	bin       string
	readyWait time.Duration  // see Slot.readyWait
	in        *io.PipeWriter // the channel's stdin
	inR       *io.PipeReader
	out       *bufio.Reader // its stdout
	outW      *io.PipeWriter
	cancel    context.CancelFunc
	ended     chan struct{} // the channel's exec returned
	err       error         // why, set before ended closes
	// ready closes once the relay's first frame was read: serving says
	// it was the relay's ready frame. Only a relay that said so takes an
	// exchange, whose frames another program would swallow.
	ready    chan struct{}
	serving  bool
	notReady error // why not serving: a read error, or ErrForged

	mu       sync.Mutex
	busy     bool // an exec uses it, or its stdin writer has not ended
	closing  bool
	answered bool // an end came from it: it is a relay
	idle     *time.Timer
	// seen are the execs whose end came, for the next request to have
	// the holder forget (what a relay that ends first kept is swept).
	seen []string
}

// For returns the slot's relay on conn for the helper bin, marked busy,
// opening it when there is none; nil when an exec must take an exec
// request of its own (the relay is busy, closing, or refused on this
// connection). For an exchange, only a relay that said it serves: one
// opened now is left for the next exchange.
func (s *Slot) For(conn *sshpool.Conn, bin string, idle time.Duration, exchange bool) *Relay {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || (s.refused.conn == conn && s.refused.bin == bin) {
		return nil
	}
	if r := s.cur; r != nil {
		r.mu.Lock()
		usable := r.conn == conn && r.bin == bin && !r.closing && r.alive()
		if usable && exchange && !r.isServing() {
			r.mu.Unlock()
			return nil
		}
		if usable && !r.busy {
			r.busy = true
			r.idle.Stop()
			r.mu.Unlock()
			return r
		}
		busy := r.busy
		r.mu.Unlock()
		if usable || busy {
			return nil
		}
		r.close()
		s.cur = nil
	}
	r := s.open(conn, bin, idle)
	s.cur = r
	if exchange {
		r.idle.Reset(idle)
		return nil
	}
	r.busy = true
	return r
}

// Close ends the slot: its relay is asked to end (its stdin ends) rather
// than cut, as a cut channel waits for the command it ran to take TERM,
// and cut after CloseGrace; every goroutine is joined.
func (s *Slot) Close() {
	s.mu.Lock()
	s.closed = true
	r := s.cur
	s.cur = nil
	s.mu.Unlock()
	if r != nil {
		r.close()
		select {
		case <-r.ended:
		case <-time.After(CloseGrace):
		}
	}
	s.cancel()
	s.wg.Wait()
}

// isServing says the relay's ready frame came.
func (r *Relay) isServing() bool {
	select {
	case <-r.ready:
		return r.serving
	default:
		return false
	}
}

// open starts `hold relay` on conn; s.mu is held.
func (s *Slot) open(conn *sshpool.Conn, bin string, idle time.Duration) *Relay {
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	ctx, cancel := context.WithCancel(s.ctx)
	r := &Relay{log: s.log, conn: conn, bin: bin, readyWait: s.readyWait, in: inW, inR: inR, out: bufio.NewReaderSize(outR, 64<<10), outW: outW, cancel: cancel, ended: make(chan struct{}), ready: make(chan struct{})}
	r.idle = time.AfterFunc(idle, r.closeIfIdle)
	r.idle.Stop()
	s.wg.Add(3)
	go func() {
		defer s.wg.Done()
		defer close(r.ready)
		// Before anyone reads the relay's output: its first frame.
		typ, p, err := helperproto.ReadHoldFrame(r.out, nil, helperproto.MaxHoldEnd)
		switch {
		case err != nil:
			r.notReady = fmt.Errorf("read the relay's first frame: %w", err)
		case typ != helperproto.HoldReady || len(p) != 0:
			r.notReady = fmt.Errorf("%w: a first frame of type %q, not the ready frame", ErrForged, typ)
		default:
			r.serving = true
		}
	}()
	go func() {
		defer s.wg.Done()
		// Output nobody reads (the relay's, unasked) must not hold the
		// channel's exec once the connection or the slot ends.
		select {
		case <-r.ended:
			return
		case <-conn.Done():
		case <-ctx.Done():
		}
		outW.CloseWithError(errClosed)
	}()
	go func() {
		defer s.wg.Done()
		defer cancel()
		// The relay's own messages are not the command's: logged,
		// bounded.
		said := &capped{left: 1 << 10}
		st, err := conn.ExecOnce(ctx, `exec "$PWD/.git/sandboxd/bin/`+bin+`" hold relay`, sshpool.Stdio{Stdin: inR, Stdout: outW, Stderr: said})
		s.log.Debug("the held execs' relay ended", "run", conn.RunID(), "code", st.Code, "signal", st.Signal, "err", err, "said", said.String())
		// Ended by itself, not asked to, before any answer: a helper
		// without the relay.
		refused := err == nil && st.Signal == ""
		if err == nil {
			err = ErrLost
		}
		r.err = err
		outW.CloseWithError(err)
		inR.CloseWithError(err)
		r.mu.Lock()
		refused = refused && !r.answered && !r.closing
		r.closing = true
		r.mu.Unlock()
		r.idle.Stop()
		close(r.ended)
		if refused && s.ctx.Err() == nil {
			// A helper without the relay (an older file): not asked
			// again on this connection.
			s.mu.Lock()
			s.refused.conn, s.refused.bin = conn, bin
			s.mu.Unlock()
			s.log.Debug("the sandbox helper does not relay; held execs start their own process", "run", conn.RunID(), "helper", bin)
		}
	}()
	return r
}

func (r *Relay) alive() bool {
	select {
	case <-r.ended:
		return false
	case <-r.conn.Done():
		return false
	default:
		return true
	}
}

// close asks the relay to end (its stdin ends) and cuts its channel if it
// has not ended within CloseGrace.
func (r *Relay) close() {
	r.mu.Lock()
	r.closing = true
	r.mu.Unlock()
	r.idle.Stop()
	_ = r.in.Close()
	// What it still writes is nobody's: discarded, so that it never
	// waits on a reader to end.
	r.outW.CloseWithError(errClosed)
	t := time.AfterFunc(CloseGrace, r.cancel)
	go func() {
		<-r.ended
		t.Stop()
	}()
}

// closeIfIdle closes the relay unless an exec took it meanwhile.
func (r *Relay) closeIfIdle() {
	r.mu.Lock()
	busy := r.busy
	r.mu.Unlock()
	if !busy {
		r.close()
	}
}

// done ends an exec's use of the relay: it stays open for idle, or is
// closed at once when broken.
func (r *Relay) done(broken bool, idle time.Duration) {
	if broken {
		r.close()
	}
	r.mu.Lock()
	r.busy = false
	if !r.closing {
		r.idle.Reset(idle)
	}
	r.mu.Unlock()
}

// Ended is closed once the relay's channel ended.
func (r *Relay) Ended() <-chan struct{} { return r.ended }

// Call is one exec on a relay.
type Call struct {
	// Req is the request; First are frames sent with it (an exchange's
	// opening).
	Req   helperproto.RelayRequest
	First []byte
	// Feed writes the exec's stdin frames to the relay until they end;
	// CutStdin ends the reader it reads once the exec is over.
	Feed     func(io.Writer)
	CutStdin func()
	// Stdout and Stderr take the output; Signals (SSH names) and the
	// caller's end go to the held command Hold as `hold signal` execs,
	// each bounded by SignalTimeout.
	Stdout, Stderr io.Writer
	Signals        <-chan ssh.Signal
	Hold           string
	SignalTimeout  time.Duration
	// Idle is how long the relay stays open after the exec.
	Idle time.Duration
}

// Run runs c on the relay r (busy, from For). The errors: ErrNotSent
// (nothing ran: start it another way), ErrLost or sshpool.ErrConnectionLost
// (attach), ErrForged.
func (r *Relay) Run(ctx context.Context, c Call) (sshpool.ExitStatus, error) {
	id := c.Req.ID
	broken := true
	stdinDone := make(chan struct{})
	defer func() {
		// The relay is idle once the exec's stdin writer ended too: a
		// frame it still writes is taken (and dropped) before the next
		// request. Its reader ends at the cut; the writer follows at
		// once unless the relay does not read (then later).
		c.CutStdin()
		select {
		case <-stdinDone:
			r.done(broken, c.Idle)
		case <-time.After(stdinEnd):
			go func() {
				<-stdinDone
				r.done(broken, c.Idle)
			}()
		}
	}()
	r.mu.Lock()
	c.Req.Forget = r.seen
	r.seen = nil
	r.mu.Unlock()
	b, _ := json.Marshal(c.Req)
	sent := make(chan error, 1)
	go func() {
		_, err := r.in.Write(append(helperproto.AppendHoldFrame(nil, helperproto.HoldRequest, b), c.First...))
		sent <- err
	}()
	var err error
	select {
	case err = <-sent:
	case <-ctx.Done():
		// A write still pending was not read from the pipe: closing the
		// relay fails it, and nothing ran.
		r.close()
		err = <-sent
	}
	if err != nil {
		close(stdinDone)
		return sshpool.ExitStatus{}, fmt.Errorf("%w: %w", ErrNotSent, err)
	}
	go func() {
		defer close(stdinDone)
		c.Feed(r.in)
	}()
	// The ready frame is read first (open); a relay that sent something
	// else is no relay, and one that says nothing (a file of the sandbox
	// in the helper's place) is cut at the caller's end or the bound.
	var notReady error
	bound := time.NewTimer(r.readyWait)
	select {
	case <-r.ready:
		notReady = r.notReady
	case <-ctx.Done():
		r.close()
		<-r.ready
		if !r.serving {
			return sshpool.ExitStatus{}, fmt.Errorf("the held command was cancelled before the sandbox helper's relay answered: %w", ctx.Err())
		}
	case <-bound.C:
		r.close()
		<-r.ready
		notReady = fmt.Errorf("the sandbox helper's relay said nothing within %s of its start", r.readyWait)
	}
	bound.Stop()
	if !r.serving {
		r.close()
		if errors.Is(notReady, ErrForged) {
			return sshpool.ExitStatus{}, notReady
		}
		<-r.ended
		return sshpool.ExitStatus{}, r.lost(notReady)
	}
	execDone := make(chan struct{})
	var side sync.WaitGroup
	side.Add(1)
	go func() {
		defer side.Done()
		r.signals(ctx, execDone, c)
	}()
	st, err := readRelay(r.out, id, c.Stdout, c.Stderr)
	close(execDone)
	side.Wait()
	switch {
	case err == nil:
		broken = false
		r.mu.Lock()
		r.answered = true
		if !c.Req.Exchange && len(r.seen) < helperproto.MaxForget {
			r.seen = append(r.seen, id)
		}
		r.mu.Unlock()
		if ctx.Err() != nil {
			return st, fmt.Errorf("the held command was cancelled: %w", ctx.Err())
		}
		return st, nil
	case errors.Is(err, ErrForged):
		return st, err
	}
	// The channel ended: the relay's exec says why.
	<-r.ended
	if ctx.Err() != nil {
		return st, fmt.Errorf("the held command was cancelled: %w", ctx.Err())
	}
	return st, r.lost(err)
}

// lost is why an exec on the ended relay ended: its connection's loss, or
// the relay's (killed).
func (r *Relay) lost(err error) error {
	if errors.Is(r.err, sshpool.ErrConnectionLost) {
		return r.err
	}
	select {
	case <-r.conn.Done():
		return fmt.Errorf("%w: %w", sshpool.ErrConnectionLost, err)
	default:
	}
	return fmt.Errorf("%w: %w", ErrLost, err)
}

// signals sends the caller's signals to the held command c.Hold as `hold
// signal` execs until execDone; when the caller goes away (ctx), TERM,
// then KILL after killGrace, then the relay is given up.
func (r *Relay) signals(ctx context.Context, execDone <-chan struct{}, c Call) {
	signal := func(sig ssh.Signal) {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.SignalTimeout)
		defer cancel()
		_, err := r.conn.ExecOnce(sctx, fmt.Sprintf("exec .git/sandboxd/bin/%s hold signal %s %s", r.bin, c.Hold, sig), sshpool.Stdio{})
		if err != nil {
			r.log.Debug("signal a held command", "run", r.conn.RunID(), "exec", c.Hold, "signal", sig, "err", err)
		}
	}
	sigs := c.Signals
	for {
		select {
		case <-execDone:
			return
		case <-ctx.Done():
			// The caller went away: the command is stopped as a plain
			// exec's would be.
			for _, sig := range []ssh.Signal{ssh.SIGTERM, ssh.SIGKILL} {
				signal(sig)
				select {
				case <-execDone:
					return
				case <-time.After(killGrace):
				}
			}
			r.close()
			return
		case sig, ok := <-sigs:
			if !ok {
				sigs = nil
				continue
			}
			if _, known := sshpool.SignalNumber(string(sig)); known {
				signal(sig)
			}
		}
	}
}

// readRelay reads the relay's frames for exec id until its end: output
// to stdout and stderr, the end's exit code. Every frame is checked: its
// type, its size (the stream's bounds), an end that names id with an
// exit code 0..255; anything else is ErrForged.
func readRelay(r io.Reader, id string, stdout, stderr io.Writer) (sshpool.ExitStatus, error) {
	buf := make([]byte, helperproto.MaxHoldFrame)
	for {
		typ, p, err := helperproto.ReadHoldFrame(r, buf, helperproto.MaxHoldFrame)
		if err != nil {
			var pe *helperproto.HoldFrameSizeError
			if errors.As(err, &pe) {
				return sshpool.ExitStatus{}, fmt.Errorf("%w: %w", ErrForged, err)
			}
			return sshpool.ExitStatus{}, fmt.Errorf("read the relay's frame: %w", err)
		}
		switch typ {
		case helperproto.HoldOut:
			_, _ = stdout.Write(p)
		case helperproto.HoldErr:
			_, _ = stderr.Write(p)
		case helperproto.HoldEnd:
			if len(p) > helperproto.MaxHoldEnd {
				return sshpool.ExitStatus{}, fmt.Errorf("%w: an end of %d bytes", ErrForged, len(p))
			}
			var end helperproto.RelayEnd
			if err := json.Unmarshal(p, &end); err != nil {
				return sshpool.ExitStatus{}, fmt.Errorf("%w: an unreadable end: %w", ErrForged, err)
			}
			if end.ID != id {
				return sshpool.ExitStatus{}, fmt.Errorf("%w: an end for another exec (%.64q)", ErrForged, end.ID)
			}
			if end.ExitCode < 0 || end.ExitCode > 255 {
				return sshpool.ExitStatus{}, fmt.Errorf("%w: exit code %d", ErrForged, end.ExitCode)
			}
			return sshpool.ExitStatus{Code: end.ExitCode}, nil
		default:
			return sshpool.ExitStatus{}, fmt.Errorf("%w: a frame of type %q", ErrForged, typ)
		}
	}
}

// capped keeps at most left bytes of what it is given.
type capped struct {
	bytes.Buffer
	left int
}

func (c *capped) Write(p []byte) (int, error) {
	n := len(p)
	if len(p) > c.left {
		p = p[:c.left]
	}
	c.left -= len(p)
	c.Buffer.Write(p)
	return n, nil
}

package sessions

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/daemon/gitsync"
	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/internal/helperproto"
	"github.com/sandboxd/sandboxd/store"
	"golang.org/x/crypto/ssh"
)

// The relay (docs/durable-exec.md, "Cost"): one long-lived `hold relay`
// channel per kept connection, opened by the first held exec on it, that
// starts and relays each held exec in turn, so that a held exec costs no
// exec request, channel or process of its own. It belongs to the
// sandbox's controller; an exec uses it when it is up and idle, else
// `hold start` as before. Every frame it sends is the sandbox's word.

// DefaultRelayIdle is how long a relay stays open after its last exec.
// An open channel keeps localcloud's agent busy (no idle stop while it is
// open), so this stays far below any agent's idle deadline.
const DefaultRelayIdle = 30 * time.Second

// relayKillGrace is how long a held command whose caller went away gets
// after TERM before KILL, and after KILL before the relay is given up.
const relayKillGrace = 2 * time.Second

// relayStdinEnd is how long an exec that ended waits for its stdin
// writer to end before it leaves the relay busy until then: the next exec
// finds it idle.
const relayStdinEnd = 100 * time.Millisecond

// relayCloseGrace is how long a relay asked to close (its stdin ended)
// gets to end before its channel is cut.
const relayCloseGrace = 5 * time.Second

var (
	// errRelayNotSent: the request never reached the relay; nothing ran.
	errRelayNotSent = errors.New("the relay did not take the request")
	// errRelayLost: the relay's channel ended while the command ran, its
	// connection fine (the relay was killed): the command is attached to.
	errRelayLost = errors.New("the sandbox helper's relay ended while the command ran")
	// errRelayClosed: the relay was closed by this side.
	errRelayClosed = errors.New("the relay was closed")
	// errRelayForged: the relay answered something no relay sends.
	errRelayForged = errors.New("the sandbox helper's relay answered a malformed frame")
)

// heldRelay is one `hold relay` channel.
type heldRelay struct {
	conn   *sshpool.Conn
	bin    string
	in     *io.PipeWriter // the channel's stdin
	inR    *io.PipeReader
	out    *bufio.Reader // its stdout
	outW   *io.PipeWriter
	cancel context.CancelFunc
	ended  chan struct{} // the channel's exec returned
	err    error         // why, set before ended closes
	// ready closes once the relay's first frame was read: serving says
	// it was the relay's ready frame. Only a relay that said so takes an
	// exchange, whose frames another program would swallow.
	ready    chan struct{}
	serving  bool
	notReady error // why not serving: a read error, or errRelayForged

	mu       sync.Mutex
	busy     bool // an exec uses it, or its stdin writer has not ended
	closing  bool
	answered bool // an end came from it: it is a relay
	idle     *time.Timer
	// seen are the execs whose end came, for the next request to have
	// the holder forget (what a relay that ends first kept is swept).
	seen []string
}

// relayFor returns the controller's relay on conn for the helper bin,
// marked busy, opening it when there is none; nil when an exec must use
// `hold start` (the relay is busy, closing, or refused on this connection).
// For an exchange, only a relay that said it serves: one opened now is
// left for the next exchange.
func (c *sandbox) relayFor(conn *sshpool.Conn, bin string, idle time.Duration, exchange bool) *heldRelay {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || (c.noRelay.conn == conn && c.noRelay.bin == bin) {
		return nil
	}
	if r := c.relay; r != nil {
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
		c.relay = nil
	}
	r := c.openRelay(conn, bin, idle)
	c.relay = r
	if exchange {
		r.idle.Reset(idle)
		return nil
	}
	r.busy = true
	return r
}

// isServing says the relay's ready frame came.
func (r *heldRelay) isServing() bool {
	select {
	case <-r.ready:
		return r.serving
	default:
		return false
	}
}

// openRelay starts `hold relay` on conn; c.mu is held.
func (c *sandbox) openRelay(conn *sshpool.Conn, bin string, idle time.Duration) *heldRelay {
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	ctx, cancel := context.WithCancel(c.ctx)
	r := &heldRelay{conn: conn, bin: bin, in: inW, inR: inR, out: bufio.NewReaderSize(outR, 64<<10), outW: outW, cancel: cancel, ended: make(chan struct{}), ready: make(chan struct{})}
	r.idle = time.AfterFunc(idle, r.closeIfIdle)
	r.idle.Stop()
	c.wg.Add(3)
	go func() {
		defer c.wg.Done()
		defer close(r.ready)
		// Before anyone reads the relay's output: its first frame.
		typ, p, err := helperproto.ReadHoldFrame(r.out, nil, helperproto.MaxHoldEnd)
		switch {
		case err != nil:
			r.notReady = fmt.Errorf("read the relay's first frame: %w", err)
		case typ != helperproto.HoldReady || len(p) != 0:
			r.notReady = fmt.Errorf("%w: a first frame of type %q, not the ready frame", errRelayForged, typ)
		default:
			r.serving = true
		}
	}()
	go func() {
		defer c.wg.Done()
		// Output nobody reads (the relay's, unasked) must not hold the
		// channel's exec once the connection or the controller ends.
		select {
		case <-r.ended:
			return
		case <-conn.Done():
		case <-ctx.Done():
		}
		outW.CloseWithError(errRelayClosed)
	}()
	go func() {
		defer c.wg.Done()
		defer cancel()
		// The relay's own messages are not the command's: logged,
		// bounded.
		var said bytes.Buffer
		st, err := conn.ExecOnce(ctx, `exec "$PWD/.git/sandboxd/bin/`+bin+`" hold relay`, sshpool.Stdio{Stdin: inR, Stdout: outW, Stderr: &limitWriter{w: &said, left: 1 << 10}})
		c.m.log.Debug("the held execs' relay ended", "run", conn.RunID(), "code", st.Code, "signal", st.Signal, "err", err, "said", said.String())
		// Ended by itself, not asked to, before any answer: a helper
		// without the relay.
		refused := err == nil && st.Signal == ""
		if err == nil {
			err = errRelayLost
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
		if refused && c.ctx.Err() == nil {
			// A helper without the relay (an older file): not asked
			// again on this connection.
			c.mu.Lock()
			c.noRelay.conn, c.noRelay.bin = conn, bin
			c.mu.Unlock()
			c.m.log.Debug("the sandbox helper does not relay; held execs start their own process", "run", conn.RunID(), "helper", bin)
		}
	}()
	return r
}

func (r *heldRelay) alive() bool {
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
// has not ended within relayCloseGrace.
func (r *heldRelay) close() {
	r.mu.Lock()
	r.closing = true
	r.mu.Unlock()
	r.idle.Stop()
	_ = r.in.Close()
	// What it still writes is nobody's: discarded, so that it never
	// waits on a reader to end.
	r.outW.CloseWithError(errRelayClosed)
	t := time.AfterFunc(relayCloseGrace, r.cancel)
	go func() {
		<-r.ended
		t.Stop()
	}()
}

// closeIfIdle closes the relay unless an exec took it meanwhile.
func (r *heldRelay) closeIfIdle() {
	r.mu.Lock()
	busy := r.busy
	r.mu.Unlock()
	if !busy {
		r.close()
	}
}

// done ends an exec's use of the relay: it stays open for idle, or is
// closed at once when broken.
func (r *heldRelay) done(broken bool, idle time.Duration) {
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

// relayed runs command (id) on the relay r, holding lc's lock: the
// output to stdio's writers, stdin from stdio.Stdin (hold's frames: the
// empty one is the end), signals and the caller's end as `hold signal`
// execs. The errors: errRelayNotSent (nothing ran: start it another way),
// errRelayLost or sshpool.ErrConnectionLost (attach), errRelayForged.
func (m *Manager) relayed(ctx context.Context, r *heldRelay, lc *sshpool.Locked, id, command string, stdio sshpool.Stdio, cutStdin func()) (sshpool.ExitStatus, error) {
	req := helperproto.RelayRequest{ID: id, Argv: []string{"sh", "-c", command}}
	return m.relay(ctx, r, lc, req, nil, func(w io.Writer) { relayStdin(w, stdio.Stdin) }, cutStdin, id, stdio)
}

// relayExchanges runs the held exchanges of session s on lc through its
// controller's relay (gitsync.ExchangeRunner): the helper's side runs in
// the relay's process, so an exchange costs no exec request and no
// process start.
type relayExchanges struct {
	m      *Manager
	s      *store.Session
	lc     *sshpool.Locked
	helper string
}

// RunExchange runs x on the relay when it is up and idle (taken false
// otherwise, nothing read): its opening in the request, the exchange's
// frames on stdin as the relay's stdin frames, its answers to stdout, the
// helper's messages to stderr. A relay that ended (killed) while the
// exchange ran, its connection fine, is an exec that ended without a
// status: the exchange's own rules (a reattach) follow.
func (e relayExchanges) RunExchange(ctx context.Context, x gitsync.RelayedExchange, stdin io.Reader, stdout, stderr io.Writer) (int, bool, error) {
	r := e.m.sandboxOf(e.s).relayFor(e.lc.Conn, e.helper, e.m.relayIdle(), true)
	if r == nil {
		return 0, false, nil
	}
	req := helperproto.RelayRequest{ID: newExecID(), Exchange: true, Setup: x.Setup, SetupDone: x.SetupDone}
	opening := helperproto.AppendHoldFrame(nil, helperproto.HoldIn, x.Opening)
	cut := func() {
		if c, ok := stdin.(io.Closer); ok {
			_ = c.Close()
		}
	}
	st, err := e.m.relay(ctx, r, e.lc, req, opening, func(w io.Writer) { relayRaw(w, stdin) }, cut, x.Hold, sshpool.Stdio{Stdout: stdout, Stderr: stderr})
	switch {
	case errors.Is(err, errRelayNotSent):
		e.m.log.Debug("the relay did not take an exchange; it runs on its own channel", "run", e.s.RunID, "err", err)
		return 0, false, nil
	case errors.Is(err, errRelayLost):
		return -1, true, nil
	case err != nil:
		return -1, true, err
	}
	return st.Code, true, nil
}

// relayRaw copies src to the relay as its 'i' frames, and its end as 'z',
// until src or the relay ends.
func relayRaw(w io.Writer, src io.Reader) {
	buf := make([]byte, maxStdinFrame)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if _, werr := w.Write(helperproto.AppendHoldFrame(nil, helperproto.HoldIn, buf[:n])); werr != nil {
				return
			}
		}
		if errors.Is(err, io.EOF) {
			_, _ = w.Write(helperproto.AppendHoldFrame(nil, helperproto.HoldInEnd, nil))
		}
		if err != nil {
			return
		}
	}
}

// relay sends req (and first, frames that go with it) to the relay r,
// then what feed writes, and reads the exec's output to stdio's writers
// until its end; signals and the caller's end go to the held command
// hold as `hold signal` execs.
func (m *Manager) relay(ctx context.Context, r *heldRelay, lc *sshpool.Locked, req helperproto.RelayRequest, first []byte, feed func(io.Writer), cutStdin func(), hold string, stdio sshpool.Stdio) (sshpool.ExitStatus, error) {
	id := req.ID
	broken := true
	stdinDone := make(chan struct{})
	defer func() {
		// The relay is idle once the exec's stdin writer ended too: a
		// frame it still writes is taken (and dropped) before the next
		// request. Its reader ends at the cut; the writer follows at
		// once unless the relay does not read (then later).
		cutStdin()
		select {
		case <-stdinDone:
			r.done(broken, m.relayIdle())
		case <-time.After(relayStdinEnd):
			go func() {
				<-stdinDone
				r.done(broken, m.relayIdle())
			}()
		}
	}()
	// Probed from the request on: a relay channel still being opened on a
	// connection gone silent is found by the probes, not the keepalives.
	defer m.probeConn(ctx, lc.Conn, afterHeld)()
	r.mu.Lock()
	req.Forget = r.seen
	r.seen = nil
	r.mu.Unlock()
	b, _ := json.Marshal(req)
	sent := make(chan error, 1)
	go func() {
		_, err := r.in.Write(append(helperproto.AppendHoldFrame(nil, helperproto.HoldRequest, b), first...))
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
		return sshpool.ExitStatus{}, fmt.Errorf("%w: %w", errRelayNotSent, err)
	}
	go func() {
		defer close(stdinDone)
		feed(r.in)
	}()
	// The ready frame is read first (openRelay); a relay that sent
	// something else is no relay.
	<-r.ready
	if !r.serving {
		r.close()
		if errors.Is(r.notReady, errRelayForged) {
			return sshpool.ExitStatus{}, r.notReady
		}
		<-r.ended
		select {
		case <-r.conn.Done():
			return sshpool.ExitStatus{}, fmt.Errorf("%w: %w", sshpool.ErrConnectionLost, r.notReady)
		default:
		}
		if errors.Is(r.err, sshpool.ErrConnectionLost) {
			return sshpool.ExitStatus{}, r.err
		}
		return sshpool.ExitStatus{}, fmt.Errorf("%w: %w", errRelayLost, r.notReady)
	}
	execDone := make(chan struct{})
	var side sync.WaitGroup
	side.Add(1)
	go func() {
		defer side.Done()
		m.relaySignals(ctx, execDone, r, lc.Conn, hold, stdio.Signals)
	}()
	st, err := readRelay(r.out, id, stdio.Stdout, stdio.Stderr)
	close(execDone)
	side.Wait()
	switch {
	case err == nil:
		broken = false
		r.mu.Lock()
		r.answered = true
		if !req.Exchange && len(r.seen) < helperproto.MaxForget {
			r.seen = append(r.seen, id)
		}
		r.mu.Unlock()
		if ctx.Err() != nil {
			return st, fmt.Errorf("the held command was cancelled: %w", ctx.Err())
		}
		return st, nil
	case errors.Is(err, errRelayForged):
		return st, err
	}
	// The channel ended: the relay's exec says why.
	<-r.ended
	if ctx.Err() != nil {
		return st, fmt.Errorf("the held command was cancelled: %w", ctx.Err())
	}
	if errors.Is(r.err, sshpool.ErrConnectionLost) {
		return st, r.err
	}
	select {
	case <-r.conn.Done():
		return st, fmt.Errorf("%w: %w", sshpool.ErrConnectionLost, err)
	default:
	}
	return st, fmt.Errorf("%w: %w", errRelayLost, err)
}

// relayStdin copies the exec's stdin, in hold's frames, to the relay as
// its 'i' and 'z' frames, until the end frame or the reader's end.
func relayStdin(w io.Writer, src io.Reader) {
	if src == nil {
		_, _ = w.Write(helperproto.AppendHoldFrame(nil, helperproto.HoldInEnd, nil))
		return
	}
	br := bufio.NewReaderSize(src, maxStdinFrame+frameHeader)
	buf := make([]byte, maxStdinFrame)
	var hdr [frameHeader]byte
	for {
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			return
		}
		n := int(binary.BigEndian.Uint32(hdr[:]))
		if n == 0 {
			_, _ = w.Write(helperproto.AppendHoldFrame(nil, helperproto.HoldInEnd, nil))
			return
		}
		if n > maxStdinFrame {
			return
		}
		if _, err := io.ReadFull(br, buf[:n]); err != nil {
			return
		}
		if _, err := w.Write(helperproto.AppendHoldFrame(nil, helperproto.HoldIn, buf[:n])); err != nil {
			return
		}
	}
}

// relaySignals sends the caller's signals to the command of id as `hold
// signal` execs until execDone; when the caller goes away (ctx), TERM,
// then KILL after relayKillGrace, then the relay is given up.
func (m *Manager) relaySignals(ctx context.Context, execDone <-chan struct{}, r *heldRelay, conn *sshpool.Conn, id string, sigs <-chan ssh.Signal) {
	signal := func(sig ssh.Signal) {
		_, probeTimeout := m.waitBounds()
		c, cancel := context.WithTimeout(context.WithoutCancel(ctx), probeTimeout+helperStartSlack)
		defer cancel()
		_, err := conn.ExecOnce(c, fmt.Sprintf("exec .git/sandboxd/bin/%s hold signal %s %s", r.bin, id, sig), sshpool.Stdio{})
		if err != nil {
			m.log.Debug("signal a held command", "run", conn.RunID(), "exec", id, "signal", sig, "err", err)
		}
	}
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
				case <-time.After(relayKillGrace):
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
// exit code 0..255; anything else is errRelayForged.
func readRelay(r io.Reader, id string, stdout, stderr io.Writer) (sshpool.ExitStatus, error) {
	buf := make([]byte, helperproto.MaxHoldFrame)
	for {
		typ, p, err := helperproto.ReadHoldFrame(r, buf, helperproto.MaxHoldFrame)
		if err != nil {
			var pe *helperproto.HoldFrameSizeError
			if errors.As(err, &pe) {
				return sshpool.ExitStatus{}, fmt.Errorf("%w: %w", errRelayForged, err)
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
				return sshpool.ExitStatus{}, fmt.Errorf("%w: an end of %d bytes", errRelayForged, len(p))
			}
			var end helperproto.RelayEnd
			if err := json.Unmarshal(p, &end); err != nil {
				return sshpool.ExitStatus{}, fmt.Errorf("%w: an unreadable end: %w", errRelayForged, err)
			}
			if end.ID != id {
				return sshpool.ExitStatus{}, fmt.Errorf("%w: an end for another exec (%.64q)", errRelayForged, end.ID)
			}
			if end.ExitCode < 0 || end.ExitCode > 255 {
				return sshpool.ExitStatus{}, fmt.Errorf("%w: exit code %d", errRelayForged, end.ExitCode)
			}
			return sshpool.ExitStatus{Code: end.ExitCode}, nil
		default:
			return sshpool.ExitStatus{}, fmt.Errorf("%w: a frame of type %q", errRelayForged, typ)
		}
	}
}

func (m *Manager) relayIdle() time.Duration { return m.opts.RelayIdle }

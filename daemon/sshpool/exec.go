package sshpool

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"golang.org/x/crypto/ssh"
)

// Stdio are a command's streams. Nil Stdin sends EOF at once; nil Stdout or
// Stderr discards. Signals received are forwarded to the command.
type Stdio struct {
	// Preamble, when set, is written to the command's stdin as soon as
	// the exec request is sent, without waiting for the agent's answer
	// (the agent keeps channel data until the command reads it), then
	// Stdin follows: a request the command reads first costs no round
	// trip of its own. A retry on another channel writes it again.
	Preamble []byte
	Stdin    io.Reader
	Stdout   io.Writer
	Stderr   io.Writer
	Signals  <-chan ssh.Signal
	// PTY, when set, runs the command on a pseudo-terminal (pty-req);
	// Resizes then carries window changes.
	PTY     *PTY
	Resizes <-chan WindowSize
}

// PTY is a pseudo-terminal request: the terminal type and its size.
type PTY struct {
	Term       string
	Cols, Rows uint32
}

// WindowSize is a terminal size in characters.
type WindowSize struct{ Cols, Rows uint32 }

// ptyRequest is the payload of "pty-req" (RFC 4254 section 6.2).
type ptyRequest struct {
	Term                 string
	Cols, Rows, PxW, PxH uint32
	Modes                string
}

// windowChange is the payload of "window-change" (RFC 4254 section 6.7).
type windowChange struct {
	Cols, Rows, PxW, PxH uint32
}

// ExitStatus is how a command ended: Code is its exit status, or -1 when a
// signal killed it, then Signal names it without "SIG" ("INT", "KILL").
type ExitStatus struct {
	Code   int
	Signal string
}

// Exec runs command in the sandbox and streams its output until it ends.
//
// If nothing reached the agent (the channel could not be opened or the exec
// request could not be written), Exec reconnects and tries once more; the
// error then wraps ErrNotSent. Once the request may have reached the agent,
// a failure wraps ErrConnectionLost and the command is never sent again.
// When ctx ends, the command gets TERM, then KILL after KillGrace, and the
// error wraps ctx.Err().
//
// Stdin is read in a goroutine that Exec does not wait for: a reader that
// never returns must be unblocked by its owner. No write to Stdout or
// Stderr happens after Exec returns.
func (c *Conn) Exec(ctx context.Context, command string, stdio Stdio) (ExitStatus, error) {
	st, err := c.ExecOnce(ctx, command, stdio)
	if err == nil || !errors.Is(err, ErrNotSent) || ctx.Err() != nil {
		return st, err
	}
	c.pool.log.Debug("exec not sent; retrying on a fresh connection", "run", c.target.RunID, "err", err)
	c2, gerr := c.link.Get(ctx, c.target)
	if gerr != nil {
		return st, fmt.Errorf("%w; reconnecting failed: %w", err, gerr)
	}
	return c2.ExecOnce(ctx, command, stdio)
}

// ExecOnce is Exec on this connection only: when nothing reached the agent
// it returns an error wrapping ErrNotSent instead of trying another
// connection. Callers whose command needs what this connection holds (the
// agent's lock belongs to the connection that took it) use it and retry
// themselves after taking the lock on a new connection.
func (c *Conn) ExecOnce(ctx context.Context, command string, stdio Stdio) (ExitStatus, error) {
	if err := ctx.Err(); err != nil {
		return ExitStatus{}, fmt.Errorf("run a command in sandbox %s: %w", c.target.RunID, err)
	}
	s, err := c.takeSession(ctx)
	if err != nil {
		return ExitStatus{}, err
	}
	before := c.tcp.writes.Load()
	if stdio.PTY != nil {
		term := stdio.PTY.Term
		if term == "" {
			term = "xterm"
		}
		// No terminal modes: the agent's defaults (a cooked, echoing
		// terminal) are what an interactive shell expects.
		req := ptyRequest{Term: term, Cols: stdio.PTY.Cols, Rows: stdio.PTY.Rows, Modes: "\x00"}
		ok, err := c.request(ctx, s, "pty-req", ssh.Marshal(req))
		if err != nil || !ok {
			s.ch.Close()
			if err == nil {
				err = errors.New("the agent refused it")
			}
			return ExitStatus{}, fmt.Errorf("%w: ask sandbox %s for a pseudo-terminal: %w", ErrNotSent, c.target.RunID, err)
		}
	}
	var preambleSent chan struct{}
	if len(stdio.Preamble) > 0 {
		// Beside the exec request, not after its answer.
		preambleSent = make(chan struct{})
		go func() {
			defer close(preambleSent)
			_, _ = s.ch.Write(stdio.Preamble)
		}()
	}
	ok, err := c.request(ctx, s, "exec", ssh.Marshal(struct{ Command string }{command}))
	if err != nil {
		s.ch.Close()
		// Nothing written since the request was built: it never left
		// this machine.
		left := c.tcp.writes.Load() != before
		switch {
		case !left:
			// A caller that gave up, or io.EOF (the channel closed under
			// us), says nothing of the connection; any other error is a
			// broken transport.
			if ctx.Err() == nil && !errors.Is(err, io.EOF) {
				c.close(fmt.Errorf("send an exec request: %w", err))
			}
			return ExitStatus{}, fmt.Errorf("%w: send the exec request to sandbox %s: %w", ErrNotSent, c.target.RunID, err)
		case ctx.Err() != nil:
			return ExitStatus{}, fmt.Errorf("command in sandbox %s cancelled before the agent answered its exec request (it may or may not have started, so it was not sent again): %w", c.target.RunID, ctx.Err())
		}
		c.close(fmt.Errorf("exec request without answer: %w", err))
		return ExitStatus{}, fmt.Errorf("%w (sandbox %s; the command may or may not have started, so it was not sent again): %w", ErrConnectionLost, c.target.RunID, err)
	}
	// Open the next spare now, while this command runs, so that the next
	// exec (a burst, a push then a command) never waits for a channel
	// open; not before the exec request, which the agent would then serve
	// second.
	c.prepareSpares()
	if !ok {
		s.ch.Close()
		return ExitStatus{}, fmt.Errorf("%w (sandbox %s)", ErrRefused, c.target.RunID)
	}
	// From here on the command may be running: whatever happens, it is
	// never sent again.
	return c.stream(ctx, s, stdio, preambleSent)
}

// request sends a channel request that wants a reply and waits for the
// reply until ctx ends: x/crypto/ssh waits without a bound, and an agent
// that takes the request and never answers would hold the caller for
// ever. A request given up on leaves the channel to close.
func (c *Conn) request(ctx context.Context, s *session, name string, payload []byte) (bool, error) {
	type reply struct {
		ok  bool
		err error
	}
	done := make(chan reply, 1)
	go func() {
		ok, err := s.ch.SendRequest(name, true, payload)
		done <- reply{ok, err}
	}()
	select {
	case r := <-done:
		return r.ok, r.err
	case <-ctx.Done():
		s.ch.Close()
		return false, ctx.Err()
	}
}

// stream relays the streams of a started command and collects its status.
func (c *Conn) stream(ctx context.Context, s *session, stdio Stdio, preambleSent <-chan struct{}) (ExitStatus, error) {
	stdout, stderr := newGate(stdio.Stdout), newGate(stdio.Stderr)
	defer stdout.close()
	defer stderr.close()

	var copies sync.WaitGroup
	copies.Add(2)
	go func() { defer copies.Done(); c.pool.relay(stdout, s.ch) }()
	go func() { defer copies.Done(); c.pool.relay(stderr, s.ch.Stderr()) }()
	switch {
	case stdio.Stdin != nil:
		go func() {
			if preambleSent != nil {
				<-preambleSent
			}
			c.pool.relay(s.ch, stdio.Stdin)
			_ = s.ch.CloseWrite()
		}()
	case preambleSent != nil:
		go func() {
			<-preambleSent
			_ = s.ch.CloseWrite()
		}()
	default:
		_ = s.ch.CloseWrite()
	}
	finished := make(chan struct{})
	go func() {
		copies.Wait()
		<-s.closed
		close(finished)
	}()

	signals, resizes := stdio.Signals, stdio.Resizes
	for {
		select {
		case <-finished:
			return c.status(s)
		case ws, ok := <-resizes:
			if !ok {
				resizes = nil
				continue
			}
			if _, err := s.ch.SendRequest("window-change", false, ssh.Marshal(windowChange{Cols: ws.Cols, Rows: ws.Rows})); err != nil {
				c.pool.log.Debug("forward a window change", "run", c.target.RunID, "err", err)
			}
		case sig, ok := <-signals:
			if !ok {
				signals = nil
				continue
			}
			if err := s.sendSignal(sig); err != nil {
				c.pool.log.Debug("forward signal", "run", c.target.RunID, "signal", sig, "err", err)
			}
		case <-ctx.Done():
			return c.cancel(ctx, s, finished)
		}
	}
}

// relay copies src to w until either ends, with a buffer from the pool's.
func (p *Pool) relay(w io.Writer, src io.Reader) {
	b, _ := p.copyBufs.Get().(*[]byte)
	if b == nil {
		buf := make([]byte, copyBufSize)
		b = &buf
	}
	_, _ = io.CopyBuffer(w, src, *b)
	p.copyBufs.Put(b)
}

// cancel stops a running command whose caller went away: TERM, then KILL
// after the grace period, then the channel is abandoned.
func (c *Conn) cancel(ctx context.Context, s *session, finished <-chan struct{}) (ExitStatus, error) {
	grace := c.pool.opts.KillGrace
	_ = s.sendSignal(ssh.SIGTERM)
	select {
	case <-finished:
		st, _ := c.status(s)
		return st, fmt.Errorf("command in sandbox %s cancelled: %w", c.target.RunID, ctx.Err())
	case <-c.pool.opts.After(grace):
	}
	_ = s.sendSignal(ssh.SIGKILL)
	_ = s.ch.Close()
	select {
	case <-finished:
	case <-c.pool.opts.After(grace):
		c.pool.log.Warn("cancelled command did not end after KILL", "run", c.target.RunID)
	}
	st, _ := c.status(s)
	return st, fmt.Errorf("command in sandbox %s cancelled (killed after %s): %w", c.target.RunID, grace, ctx.Err())
}

// status reads the exit report of a closed session.
func (c *Conn) status(s *session) (ExitStatus, error) {
	select {
	case <-s.closed:
	default:
		return ExitStatus{Code: -1}, fmt.Errorf("%w: the command's channel did not close", ErrConnectionLost)
	}
	switch {
	case s.signal != "":
		return ExitStatus{Code: -1, Signal: s.signal}, nil
	case s.status != nil:
		return ExitStatus{Code: *s.status}, nil
	}
	c.mu.Lock()
	reason := c.err
	c.mu.Unlock()
	if reason == nil {
		reason = errors.New("the agent closed the command's channel without an exit status")
	}
	return ExitStatus{Code: -1}, fmt.Errorf("%w (sandbox %s; it may or may not have completed, so it was not sent again): %w", ErrConnectionLost, c.target.RunID, reason)
}

// gate forwards writes until closed and drops them afterwards, so that a
// command's output never reaches the caller's writers after Exec returned.
// After the caller's writer fails it keeps draining (discarding), so that a
// command is never stalled by a full SSH window nobody reads.
type gate struct {
	mu     sync.Mutex
	w      io.Writer
	closed bool
	failed bool
}

func newGate(w io.Writer) *gate {
	if w == nil {
		w = io.Discard
	}
	return &gate{w: w}
}

func (g *gate) Write(p []byte) (int, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed || g.failed {
		return len(p), nil
	}
	if _, err := g.w.Write(p); err != nil {
		g.failed = true
	}
	return len(p), nil
}

func (g *gate) close() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
}

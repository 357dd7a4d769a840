package sshpool

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"golang.org/x/crypto/ssh"
)

// Conn is one SSH connection to a sandbox, shared by every exec on it.
type Conn struct {
	pool   *Pool
	link   *Link // the link that dialed it
	target Target
	client *ssh.Client
	tcp    *countingConn
	done   chan struct{} // closed once the connection is over

	mu      sync.Mutex
	closing bool  // closed or closing: no new work
	err     error // why it ended
	// spares are session channels opened ahead of use for execs, oldest
	// first. Two, because an exec after an idle lease needs two channels
	// at once (the lock request, then the command) and a client's next
	// exec may come sooner than a channel open takes: neither should wait
	// for a round trip.
	spares []*spareCall
	// fire is the spare of Send, kept apart so a message sent without
	// waiting never takes the channel the next Exec expects.
	fire *spareCall
}

// spareSessions is how many exec channels a connection keeps open ahead of
// use (see Conn.spares).
const spareSessions = 2

// spareCall is a session channel being opened ahead of use.
type spareCall struct {
	done chan struct{}
	s    *session
	err  error
}

func newConn(p *Pool, e *Link, t Target, client *ssh.Client, tcp *countingConn) *Conn {
	return &Conn{pool: p, link: e, target: t, client: client, tcp: tcp, done: make(chan struct{})}
}

// RunID returns the run this connection reaches.
func (c *Conn) RunID() string { return c.target.RunID }

// Done is closed once the connection is over.
func (c *Conn) Done() <-chan struct{} { return c.done }

// start launches the connection's goroutines and opens the first spare
// session. The caller holds pool.mu with the pool open, so adding to the
// pool's WaitGroup cannot race with Close.
func (c *Conn) start() {
	c.pool.wg.Add(2)
	go c.monitor()
	go c.keepalive()
	c.prepareSpares()
}

// monitor reports the connection up, waits for its end, and reports it down.
func (c *Conn) monitor() {
	defer c.pool.wg.Done()
	c.pool.state(c.link, c.target.RunID, true, nil)
	werr := c.client.Wait()
	c.mu.Lock()
	c.closing = true
	if c.err == nil {
		if werr == nil {
			werr = io.EOF
		}
		c.err = fmt.Errorf("the sandbox closed the connection: %w", werr)
	}
	reason := c.err
	c.mu.Unlock()
	close(c.done)
	c.pool.connDown(c, reason)
}

// keepalive sends keepalive@openssh.com every interval; a missing reply
// within the timeout means the connection is dead (a silent network drop
// otherwise goes unnoticed until an exec hangs).
func (c *Conn) keepalive() {
	defer c.pool.wg.Done()
	opts := c.pool.opts
	for {
		select {
		case <-c.done:
			return
		case <-opts.After(opts.KeepaliveInterval):
		}
		reply := make(chan error, 1)
		go func() {
			// Any answer, even a refusal, proves the peer is alive.
			_, _, err := c.client.SendRequest("keepalive@openssh.com", true, nil)
			reply <- err
		}()
		select {
		case err := <-reply:
			if err != nil {
				c.close(fmt.Errorf("keepalive failed: %w", err))
				return
			}
		case <-opts.After(opts.KeepaliveTimeout):
			c.close(fmt.Errorf("%w (no answer within %s)", ErrKeepaliveTimeout, opts.KeepaliveTimeout))
			return
		case <-c.done:
			return
		}
	}
}

// close ends the connection for reason (the first reason given wins).
func (c *Conn) close(reason error) {
	c.mu.Lock()
	if c.err == nil {
		c.err = reason
	}
	c.closing = true
	c.mu.Unlock()
	c.client.Close()
}

func (c *Conn) alive() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return !c.closing
}

// prepare opens the channel of Send's slot in the background, so that
// its next user does not pay the channel-open round trip.
func (c *Conn) prepare(slot **spareCall) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closing || *slot != nil {
		return
	}
	*slot = c.openAhead()
}

// prepareSpares opens exec channels in the background until spareSessions
// are open or opening.
func (c *Conn) prepareSpares() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for !c.closing && len(c.spares) < spareSessions {
		c.spares = append(c.spares, c.openAhead())
	}
}

// openAhead starts opening a session channel. The caller holds c.mu with
// the connection not closing, so Close has not reached the pool's Wait.
func (c *Conn) openAhead() *spareCall {
	sc := &spareCall{done: make(chan struct{})}
	c.pool.wg.Add(1)
	go func() {
		defer c.pool.wg.Done()
		// Bounded: Close waits for this goroutine.
		sc.s, sc.err = c.openSessionCtx(c.pool.ctx)
		close(sc.done)
	}()
	return sc
}

// giveBack puts back in slot (Send's) a spare that was not used, or
// discards it when the slot was filled meanwhile or the connection is
// closing.
func (c *Conn) giveBack(slot **spareCall, sc *spareCall) {
	c.mu.Lock()
	kept := !c.closing && *slot == nil
	if kept {
		*slot = sc
	}
	c.mu.Unlock()
	if !kept {
		sc.discard()
	}
}

// giveBackSpare puts an unused exec spare back first in line, or discards
// it when there are enough or the connection is closing.
func (c *Conn) giveBackSpare(sc *spareCall) {
	c.mu.Lock()
	kept := !c.closing && len(c.spares) < spareSessions
	if kept {
		c.spares = append([]*spareCall{sc}, c.spares...)
	}
	c.mu.Unlock()
	if !kept {
		sc.discard()
	}
}

// discard closes the spare's channel once it is open.
func (sc *spareCall) discard() {
	go func() {
		<-sc.done
		if sc.s != nil {
			sc.s.ch.Close()
		}
	}()
}

func (sc *spareCall) opened() bool {
	select {
	case <-sc.done:
		return true
	default:
		return false
	}
}

// takeSpare removes and returns the spare to use: the oldest one already
// open, else the oldest; nil when there is none. The caller holds c.mu.
func (c *Conn) takeSpare() *spareCall {
	if len(c.spares) == 0 {
		return nil
	}
	i := 0
	for j, sc := range c.spares {
		if sc.opened() {
			i = j
			break
		}
	}
	sc := c.spares[i]
	c.spares = append(c.spares[:i], c.spares[i+1:]...)
	return sc
}

// takeSession returns an open session channel: a spare when one is usable,
// else a new one. Failing here means nothing was sent (ErrNotSent).
func (c *Conn) takeSession(ctx context.Context) (*session, error) {
	c.mu.Lock()
	closing, reason := c.closing, c.err
	var sc *spareCall
	if !closing {
		sc = c.takeSpare()
	}
	c.mu.Unlock()
	if closing {
		return nil, fmt.Errorf("%w: %w", ErrNotSent, reason)
	}
	for sc != nil {
		select {
		case <-sc.done:
			if sc.err == nil && sc.s.usable() {
				return sc.s, nil
			}
			if sc.s != nil { // the agent closed it meanwhile: discard
				sc.s.ch.Close()
			}
			// Another spare may be open; else open one now.
			c.mu.Lock()
			sc = c.takeSpare()
			c.mu.Unlock()
		case <-ctx.Done():
			c.giveBackSpare(sc)
			return nil, fmt.Errorf("%w: %w", ErrNotSent, ctx.Err())
		}
	}
	s, err := c.openSessionCtx(ctx)
	if err != nil {
		var refused *ssh.OpenChannelError
		if !errors.As(err, &refused) && ctx.Err() == nil {
			c.close(fmt.Errorf("open a session channel: %w", err))
		}
		return nil, fmt.Errorf("%w: open a session channel on sandbox %s: %w", ErrNotSent, c.target.RunID, err)
	}
	return s, nil
}

// Send sends command as an exec request without waiting for any answer:
// not for the request's reply, nor for the command's end, so it costs no
// round trip. It is meant for agent directives whose outcome nobody needs
// (sync markers). It uses a channel opened ahead of time for the purpose
// (the first Send on a connection takes the exec spare instead), so what
// is sent next on the connection reaches the agent after it. An error
// means nothing was sent.
func (c *Conn) Send(ctx context.Context, command string) error {
	c.mu.Lock()
	sc := c.fire
	c.fire = nil
	c.mu.Unlock()
	var s *session
	if sc != nil {
		select {
		case <-sc.done:
			if sc.err == nil && sc.s.usable() {
				s = sc.s
			} else if sc.s != nil {
				sc.s.ch.Close()
			}
		case <-ctx.Done():
			c.giveBack(&c.fire, sc)
			return fmt.Errorf("%w: %w", ErrNotSent, ctx.Err())
		}
	}
	if s == nil {
		var err error
		if s, err = c.takeSession(ctx); err != nil {
			return err
		}
		defer c.prepareSpares()
	}
	defer c.prepare(&c.fire)
	if _, err := s.ch.SendRequest("exec", false, ssh.Marshal(struct{ Command string }{command})); err != nil {
		s.ch.Close()
		return fmt.Errorf("%w: send %q to sandbox %s: %w", ErrNotSent, command, c.target.RunID, err)
	}
	// The agent answers with an exit status and closes the channel; the
	// session's own goroutine reads that and the close is acknowledged by
	// the SSH library.
	return nil
}

// session is one session channel and what the agent reported on it.
type session struct {
	ch     ssh.Channel
	closed chan struct{} // the channel is closed; the fields below are final
	status *int
	signal string
	sigMsg string
}

// openSessionCtx is openSession bounded by ctx and the connection's end:
// x/crypto/ssh's channel open has neither, and an open that registers its
// channel after the connection's reader ended waits for ever (seen: six
// minutes under a lock request after a dropped connection, and a Close
// that never returned). A channel that opens after its caller gave up is
// closed.
func (c *Conn) openSessionCtx(ctx context.Context) (*session, error) {
	type opened struct {
		s   *session
		err error
	}
	res := make(chan opened, 1)
	go func() {
		s, err := c.openSession()
		res <- opened{s, err}
	}()
	giveUp := func(err error) (*session, error) {
		go func() {
			if r := <-res; r.s != nil {
				r.s.ch.Close()
			}
		}()
		return nil, err
	}
	select {
	case r := <-res:
		return r.s, r.err
	case <-ctx.Done():
		return giveUp(ctx.Err())
	case <-c.done:
		c.mu.Lock()
		err := c.err
		c.mu.Unlock()
		return giveUp(fmt.Errorf("the connection ended: %w", err))
	}
}

func (c *Conn) openSession() (*session, error) {
	var (
		ch   ssh.Channel
		reqs <-chan *ssh.Request
		err  error
	)
	if open := c.pool.openChannel; open != nil {
		ch, reqs, err = open(c.client)
	} else {
		ch, reqs, err = c.client.OpenChannel("session", nil)
	}
	if err != nil {
		return nil, err
	}
	s := &session{ch: ch, closed: make(chan struct{})}
	// Bounded by the channel's life, which the connection's bounds.
	go s.serve(reqs)
	return s, nil
}

// serve records exit-status / exit-signal until the channel closes.
func (s *session) serve(reqs <-chan *ssh.Request) {
	defer close(s.closed)
	for r := range reqs {
		switch r.Type {
		case "exit-status":
			var m struct{ Status uint32 }
			if ssh.Unmarshal(r.Payload, &m) == nil {
				// An exit status is 0..255; anything else from the agent
				// is a failure of unknown cause.
				code := int(min(m.Status, maxExitStatus))
				s.status = &code
			}
		case "exit-signal":
			var m struct {
				Signal     string
				CoreDumped bool
				Error      string
				Lang       string
			}
			if ssh.Unmarshal(r.Payload, &m) == nil {
				s.signal, s.sigMsg = signalName(m.Signal), truncate(m.Error, maxSignalMessage)
			}
		}
		if r.WantReply {
			_ = r.Reply(false, nil)
		}
	}
}

// Bounds of what the agent reports about a command's end.
const (
	maxExitStatus    = 255
	maxSignalMessage = 1024
)

// signalName is the agent's signal name when it is one (RFC 4254: a name
// without "SIG", or name@domain), else "UNKNOWN": it reaches the user's
// terminal and exit code.
func signalName(name string) string {
	if name == "" || len(name) > 32 {
		return "UNKNOWN"
	}
	for _, c := range name {
		if !(c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '@' || c == '.' || c == '-' || c == '_' || c == '+') {
			return "UNKNOWN"
		}
	}
	return name
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

func (s *session) usable() bool {
	select {
	case <-s.closed:
		return false
	default:
		return true
	}
}

func (s *session) sendSignal(sig ssh.Signal) error {
	_, err := s.ch.SendRequest("signal", false, ssh.Marshal(struct{ Signal string }{string(sig)}))
	return err
}

// Package sshpool keeps one persistent SSH connection per sandbox so that an
// exec costs one round trip instead of a TCP + SSH handshake. A Link is one
// sandbox's kept connection, owned by that sandbox's controller; the Pool
// holds what links share (options, the set of live connections for Close
// and ProbeAll, relay buffers). Connections are
// kept alive with keepalive requests, reconnected with backoff when they
// drop (unless the run is over), and hold two spare session channels opened
// ahead of use. A command whose exec request may have reached the agent is
// never sent again.
package sshpool

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/sandboxd/sandboxd/errdefs"
)

// Errors callers branch on.
var (
	// ErrNotSent: the command never reached the agent (the channel could not
	// be opened or the exec request could not be written). Safe to retry.
	ErrNotSent = errors.New("the command was not sent to the sandbox")
	// ErrConnectionLost: the connection failed after the exec request may
	// have reached the agent. The command may have run; never retry it.
	ErrConnectionLost = errors.New("the connection to the sandbox was lost while the command ran")
	// ErrHostKeyMismatch: the sandbox presented another host key than the
	// one the remote announced.
	ErrHostKeyMismatch = errors.New("the sandbox's SSH host key does not match the one the remote announced")
	// ErrRefused: the agent answered the exec request with a failure.
	ErrRefused = errors.New("the sandbox agent refused the command")
	// ErrKeepaliveTimeout: the agent did not answer a keepalive in time.
	ErrKeepaliveTimeout = errors.New("the sandbox did not answer a keepalive in time")
	// ErrForgotten: the session ended (Forget) while connecting.
	ErrForgotten = errors.New("the sandbox connection was closed because its session ended")
	// ErrClosed: the pool is closed.
	ErrClosed = errors.New("the SSH pool is closed")
)

// Target says how to reach one sandbox (from the remote's connection info).
type Target struct {
	RunID   string
	Address string // host:port
	// PublicHostKey is the agent's host key in authorized_keys format.
	PublicHostKey string
	// PrivateUserKey is the client key, PEM (OpenSSH or PKCS#8).
	PrivateUserKey string
}

// Options configure a Pool. Zero values get the defaults noted.
type Options struct {
	User              string        // default "rwx-cli", as today's RWX CLI
	DialTimeout       time.Duration // TCP connect + SSH handshake, default 10s
	KeepaliveInterval time.Duration // default 10s
	KeepaliveTimeout  time.Duration // no reply within it = dead, default 15s
	ReconnectMin      time.Duration // first wait after a drop, default 250ms
	ReconnectMax      time.Duration // backoff cap, default 30s
	// KillGrace is how long a cancelled command gets after TERM before KILL,
	// and after KILL before the channel is given up (default 2s).
	KillGrace time.Duration
	// After is time.After, injectable for tests.
	After  func(time.Duration) <-chan time.Time
	Logger *slog.Logger
	// CheckAlive is asked before each reconnect of an Ensure'd sandbox; an
	// error matching errdefs.ErrGone or errdefs.ErrNotFound stops
	// reconnecting for good (other errors count as a failed attempt).
	CheckAlive func(ctx context.Context, runID string) error
	// OnState reports connection up/down events (err says why it went
	// down). Called from the pool's goroutines; it must not block long.
	OnState func(runID string, up bool, err error)
}

// Pool holds what the links share. Safe for concurrent use.
type Pool struct {
	opts Options
	log  *slog.Logger

	ctx    context.Context // ended by Close
	cancel context.CancelFunc

	mu     sync.Mutex
	links  map[*Link]struct{} // every link not yet forgotten
	conns  map[*Conn]struct{} // every published, not yet dead connection
	closed bool
	wg     sync.WaitGroup

	handshakes atomic.Uint64

	// openChannel opens a session channel: nil means x/crypto/ssh's,
	// which tests replace by one that never returns (see
	// Conn.openSessionCtx).
	openChannel func(*ssh.Client) (ssh.Channel, <-chan *ssh.Request, error)

	// copyBufs are the buffers that relay a command's streams: two or
	// three per exec, which io.Copy would allocate afresh
	// (docs/performance.md).
	copyBufs sync.Pool
}

// copyBufSize is the size of a relay buffer: the most an SSH channel
// hands over in one read.
const copyBufSize = 32 << 10

// Link is one sandbox's kept connection: its target, the current
// connection, the dial in flight and whether a maintainer keeps it
// connected. Its fields are guarded by the pool's mu.
type Link struct {
	pool    *Pool
	target  Target
	conn    *Conn     // current connection; nil when none
	dial    *dialCall // dial in flight
	ensured bool      // a maintainer keeps it connected
	wake    chan struct{}
	ctx     context.Context // ended by Forget / Close
	cancel  context.CancelFunc
	onState func(up bool, err error) // set once by NewLink
}

// dialCall lets every caller wanting a connection share one dial.
type dialCall struct {
	done chan struct{}
	conn *Conn
	err  error
}

// New returns an empty pool.
func New(opts Options) *Pool {
	if opts.User == "" {
		opts.User = "rwx-cli"
	}
	if opts.DialTimeout <= 0 {
		opts.DialTimeout = 10 * time.Second
	}
	if opts.KeepaliveInterval <= 0 {
		opts.KeepaliveInterval = 10 * time.Second
	}
	if opts.KeepaliveTimeout <= 0 {
		opts.KeepaliveTimeout = 15 * time.Second
	}
	if opts.ReconnectMin <= 0 {
		opts.ReconnectMin = 250 * time.Millisecond
	}
	if opts.ReconnectMax < opts.ReconnectMin {
		opts.ReconnectMax = max(30*time.Second, opts.ReconnectMin)
	}
	if opts.KillGrace <= 0 {
		opts.KillGrace = 2 * time.Second
	}
	if opts.After == nil {
		opts.After = time.After
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Pool{
		opts: opts, log: log, ctx: ctx, cancel: cancel,
		links: make(map[*Link]struct{}), conns: make(map[*Conn]struct{}),
	}
}

// NewLink returns a link to one sandbox, not connected yet. onState,
// optional, hears its connection come up and go down (as Options.OnState,
// from the pool's goroutines: it must not block long).
func (p *Pool) NewLink(onState func(up bool, err error)) *Link {
	ctx, cancel := context.WithCancel(p.ctx)
	l := &Link{pool: p, wake: make(chan struct{}, 1), ctx: ctx, cancel: cancel, onState: onState}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		cancel()
		return l
	}
	p.links[l] = struct{}{}
	return l
}

// Get returns the sandbox's healthy connection, or dials one now (joining a
// dial already in flight). t is where the sandbox is now: when it differs
// from the link's, the link follows it.
func (l *Link) Get(ctx context.Context, t Target) (*Conn, error) {
	if t.RunID == "" || t.Address == "" {
		return nil, errdefs.Invalidf("connect to a sandbox: run id and address are required (got run %q, address %q)", t.RunID, t.Address)
	}
	p := l.pool
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, ErrClosed
	}
	if l.ctx.Err() != nil {
		p.mu.Unlock()
		return nil, ErrForgotten
	}
	l.retargetLocked(t)
	if c := l.conn; c != nil && c.alive() {
		p.mu.Unlock()
		return c, nil
	}
	dc := p.startDialLocked(l)
	p.mu.Unlock()
	select {
	case <-dc.done:
		return dc.conn, dc.err
	case <-ctx.Done():
		return nil, fmt.Errorf("connect to sandbox %s: %w", t.RunID, ctx.Err())
	}
}

// Ensure keeps the sandbox connected in the background: it connects now if
// needed and reconnects with backoff whenever the connection drops, until
// Forget, Close, or CheckAlive says the run is over.
func (l *Link) Ensure(t Target) {
	if t.RunID == "" || t.Address == "" {
		return
	}
	p := l.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || l.ctx.Err() != nil {
		return
	}
	l.retargetLocked(t)
	if l.ensured {
		select {
		case l.wake <- struct{}{}: // skip a pending backoff: the target may be new
		default:
		}
		return
	}
	l.ensured = true
	p.wg.Add(1)
	go p.maintain(t.RunID, l)
}

// Forget closes the sandbox's connection and stops reconnecting it, for
// good: the link's Get fails with ErrForgotten afterwards.
func (l *Link) Forget() {
	p := l.pool
	p.mu.Lock()
	delete(p.links, l)
	c := l.conn
	p.mu.Unlock()
	l.cancel()
	if c != nil {
		c.close(ErrForgotten)
	}
}

// Connected reports whether the link has a healthy connection.
func (l *Link) Connected() bool {
	l.pool.mu.Lock()
	defer l.pool.mu.Unlock()
	return l.conn != nil && l.conn.alive()
}

// Close closes every connection and waits for the pool's goroutines.
func (p *Pool) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	conns := make([]*Conn, 0, len(p.conns))
	for c := range p.conns {
		conns = append(conns, c)
	}
	p.mu.Unlock()
	p.cancel()
	for _, c := range conns {
		c.close(ErrClosed)
	}
	p.wg.Wait()
	return nil
}

// Handshakes returns how many SSH handshakes the pool has started.
func (p *Pool) Handshakes() uint64 { return p.handshakes.Load() }

// Live returns how many sandboxes have a healthy connection.
func (p *Pool) Live() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for e := range p.links {
		if e.conn != nil && e.conn.alive() {
			n++
		}
	}
	return n
}

// retargetLocked switches the link to t when the connection facts changed
// (the remote restarted the agent). The caller holds the pool's mu.
func (l *Link) retargetLocked(t Target) {
	if l.target == (Target{}) {
		l.target = t
		return
	}
	if l.target != t {
		l.target = t
		if old := l.conn; old != nil && old.target != t {
			l.conn = nil
			go old.close(errors.New("the sandbox's connection details changed"))
		}
	}
}

// startDialLocked starts (or joins) a dial of e's target.
func (p *Pool) startDialLocked(e *Link) *dialCall {
	if e.dial != nil {
		return e.dial
	}
	dc := &dialCall{done: make(chan struct{})}
	e.dial = dc
	t := e.target
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		c, err := p.dial(e.ctx, e, t)
		p.mu.Lock()
		e.dial = nil
		switch {
		case err != nil:
		case p.closed:
			err = ErrClosed
		case e.ctx.Err() != nil:
			err = ErrForgotten
		case e.target != t:
			err = fmt.Errorf("connect to sandbox %s: its connection details changed while connecting; retry", t.RunID)
		}
		if err != nil {
			if c != nil {
				c.client.Close()
			}
			dc.err = err
			p.mu.Unlock()
			close(dc.done)
			return
		}
		if old := e.conn; old != nil {
			go old.close(errors.New("replaced by a new connection"))
		}
		e.conn = c
		p.conns[c] = struct{}{}
		c.start() // under p.mu: Close cannot have begun waiting yet
		p.mu.Unlock()
		dc.conn = c
		close(dc.done)
	}()
	return dc
}

// dial opens and authenticates one connection to t.
func (p *Pool) dial(ctx context.Context, e *Link, t Target) (*Conn, error) {
	hostKey, _, _, _, err := ssh.ParseAuthorizedKey([]byte(t.PublicHostKey))
	if err != nil {
		return nil, fmt.Errorf("connect to sandbox %s: the host key from the remote cannot be parsed (authorized_keys format expected): %w", t.RunID, err)
	}
	signer, err := ssh.ParsePrivateKey([]byte(t.PrivateUserKey))
	if err != nil {
		return nil, fmt.Errorf("connect to sandbox %s: the user key from the remote cannot be parsed (PEM expected): %w", t.RunID, err)
	}
	cfg := &ssh.ClientConfig{
		User:              p.opts.User,
		Auth:              []ssh.AuthMethod{ssh.PublicKeys(signer)},
		HostKeyCallback:   pinnedHostKey(t, hostKey),
		HostKeyAlgorithms: hostKeyAlgorithms(hostKey),
		Timeout:           p.opts.DialTimeout,
	}
	dctx, cancel := context.WithTimeout(ctx, p.opts.DialTimeout)
	defer cancel()
	var d net.Dialer
	nc, err := d.DialContext(dctx, "tcp", t.Address)
	if err != nil {
		return nil, fmt.Errorf("connect to sandbox %s at %s: %w (is the remote up? check with `nook status`)", t.RunID, t.Address, err)
	}
	// The handshake has no context of its own: a deadline bounds it, and
	// Forget/Close interrupt it.
	_ = nc.SetDeadline(time.Now().Add(p.opts.DialTimeout))
	stop := context.AfterFunc(dctx, func() { _ = nc.SetDeadline(time.Now()) })
	tc := &countingConn{Conn: nc}
	p.handshakes.Add(1)
	sc, chans, reqs, err := ssh.NewClientConn(tc, t.Address, cfg)
	stop()
	if err != nil {
		nc.Close()
		if errors.Is(err, ErrHostKeyMismatch) {
			return nil, err
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("SSH handshake with sandbox %s at %s: %w", t.RunID, t.Address, ctx.Err())
		}
		return nil, fmt.Errorf("SSH handshake with sandbox %s at %s failed (its agent may be restarting, overloaded or gone): %w; check it with `nook status`: an ended sandbox is replaced by the next exec, `nook reset` starts a new one", t.RunID, t.Address, err)
	}
	_ = nc.SetDeadline(time.Time{})
	return newConn(p, e, t, ssh.NewClient(sc, chans, reqs), tc), nil
}

// maintain keeps an Ensure'd sandbox connected until its entry ends or the
// remote says the run is over.
func (p *Pool) maintain(runID string, e *Link) {
	defer p.wg.Done()
	var delay time.Duration // 0: connect at once (first connect after Ensure)
	for {
		p.mu.Lock()
		c, dc := e.conn, e.dial
		p.mu.Unlock()
		switch {
		case e.ctx.Err() != nil:
			return
		case c != nil && c.alive():
			select {
			case <-c.done:
				delay = p.opts.ReconnectMin
			case <-e.ctx.Done():
				return
			}
			continue
		case dc != nil: // a Get is dialing already
			select {
			case <-dc.done:
			case <-e.ctx.Done():
				return
			}
			if dc.err != nil {
				delay = p.nextDelay(delay)
			}
			continue
		}
		if delay > 0 {
			select {
			case <-p.opts.After(delay):
			case <-e.wake:
			case <-e.ctx.Done():
				return
			}
			if p.opts.CheckAlive != nil {
				if err := p.opts.CheckAlive(e.ctx, runID); err != nil {
					if errors.Is(err, errdefs.ErrGone) || errors.Is(err, errdefs.ErrNotFound) {
						p.giveUp(runID, e, err)
						return
					}
					if e.ctx.Err() != nil {
						return
					}
					p.log.Info("sandbox liveness check failed; will retry", "run", runID, "err", err, "backoff", p.nextDelay(delay))
					delay = p.nextDelay(delay)
					continue
				}
			}
		}
		p.mu.Lock()
		if e.ctx.Err() != nil {
			p.mu.Unlock()
			return
		}
		if e.conn != nil && e.conn.alive() {
			p.mu.Unlock()
			continue
		}
		dc = p.startDialLocked(e)
		p.mu.Unlock()
		select {
		case <-dc.done:
		case <-e.ctx.Done():
			return
		}
		if dc.err != nil {
			delay = p.nextDelay(delay)
			p.log.Info("reconnect to sandbox failed", "run", runID, "err", dc.err, "next", delay)
			continue
		}
		delay = 0
	}
}

func (p *Pool) nextDelay(d time.Duration) time.Duration {
	if d <= 0 {
		return p.opts.ReconnectMin
	}
	return min(2*d, p.opts.ReconnectMax)
}

// giveUp stops keeping a sandbox whose run is over.
func (p *Pool) giveUp(runID string, e *Link, err error) {
	p.mu.Lock()
	e.ensured = false
	p.mu.Unlock()
	p.log.Info("sandbox run is over; not reconnecting", "run", runID, "reason", err)
	p.state(e, runID, false, fmt.Errorf("not reconnecting: %w", err))
}

// connDown is called once per connection when it ends.
func (p *Pool) connDown(c *Conn, err error) {
	p.mu.Lock()
	delete(p.conns, c)
	// Report the end of the sandbox's current connection (or of one whose
	// session was forgotten), not of a connection already replaced.
	current := true
	if e := c.link; e != nil && e.ctx.Err() == nil {
		current = e.conn == c
		if current {
			e.conn = nil
		}
	}
	p.mu.Unlock()
	if current {
		p.log.Info("sandbox connection down", "run", c.target.RunID, "err", err)
		p.state(c.link, c.target.RunID, false, err)
	}
}

func (p *Pool) state(e *Link, runID string, up bool, err error) {
	if p.opts.OnState != nil {
		p.opts.OnState(runID, up, err)
	}
	if e != nil && e.onState != nil {
		e.onState(up, err)
	}
}

// pinnedHostKey accepts only the host key the remote announced (the
// behaviour of ssh.FixedHostKey, with an error callers can recognise).
func pinnedHostKey(t Target, want ssh.PublicKey) ssh.HostKeyCallback {
	wantBytes := want.Marshal()
	return func(_ string, _ net.Addr, got ssh.PublicKey) error {
		if bytes.Equal(got.Marshal(), wantBytes) {
			return nil
		}
		return fmt.Errorf("%w: sandbox %s at %s presented %s %s, expected %s %s; refusing to connect (if the sandbox was restarted, its connection info is stale: check it with `nook status`)",
			ErrHostKeyMismatch, t.RunID, t.Address, got.Type(), ssh.FingerprintSHA256(got), want.Type(), ssh.FingerprintSHA256(want))
	}
}

// hostKeyAlgorithms asks the server for the pinned key's type, so that a
// server holding several host keys presents the pinned one.
func hostKeyAlgorithms(k ssh.PublicKey) []string {
	if k.Type() == ssh.KeyAlgoRSA {
		return []string{ssh.KeyAlgoRSASHA512, ssh.KeyAlgoRSASHA256, ssh.KeyAlgoRSA}
	}
	return []string{k.Type()}
}

// countingConn counts successful writes: when an exec request fails, an
// unchanged count proves the request never left this machine.
type countingConn struct {
	net.Conn
	writes atomic.Uint64
}

func (c *countingConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if n > 0 {
		c.writes.Add(1)
	}
	return n, err
}

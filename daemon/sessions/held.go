package sessions

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sandboxd/sandboxd/daemon/relay"
	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/backend"
	"github.com/sandboxd/sandboxd/store"
)

// Durable execs (docs/durable-exec.md): a command run through the sandbox
// helper's holder outlives a lost connection; the daemon reattaches from
// the bytes it received.

// reattachAttempts bounds the reattaches of one exec.
const reattachAttempts = 3

// What follows a probe timeout on a held command's connection and on a
// plain one's.
const (
	afterHeld  = "the command, which goes on in the sandbox, is reattached on a new connection"
	afterPlain = "the connection is given up and the command reported as cut (exit 125)"
)

// maxHoldState bounds the answer of `hold state`.
const maxHoldState = 4 << 10

var helperFile = regexp.MustCompile(`^[a-z-]+-[0-9a-f]{16}$`)

// holderOn is the sandbox helper's file name on conn when it can hold a
// command, "" when not. The holder needs the helper's file, not its
// server: on a new connection whose server is still starting (the first
// execs after a reconnect, when a hold matters most) the file installed
// in that sandbox before serves. A helper that will not serve on conn
// (off, another platform, a failed start) holds nothing.
func (m *Manager) holderOn(conn *sshpool.Conn) string {
	m.mu.Lock()
	on := m.daemonCfg.DurableExec
	m.mu.Unlock()
	if !on || m.opts.SyncHelper == nil {
		return ""
	}
	name, inst := m.opts.SyncHelper(conn)
	if inst != "" && helperFile.MatchString(name) {
		m.helperBins.Store(conn.RunID(), name)
		return name
	}
	if m.opts.HelperUnavailable == nil || m.opts.HelperUnavailable(conn) {
		return ""
	}
	if prev, ok := m.helperBins.Load(conn.RunID()); ok {
		return prev.(string)
	}
	return ""
}

// relockBy takes the lock on a new connection for a reattach, by the
// reattach's deadline (reattach_timeout, bound, from the first loss).
func (m *Manager) relockBy(ctx context.Context, s *store.Session, by time.Time, bound time.Duration) (*sshpool.Conn, error) {
	rctx, cancel := context.WithDeadline(ctx, by)
	defer cancel()
	conn, err := m.relock(rctx, s)
	if err != nil && ctx.Err() == nil && errors.Is(rctx.Err(), context.DeadlineExceeded) {
		err = fmt.Errorf("no connection to the sandbox within reattach_timeout (%s): %w", bound, err)
	}
	return conn, err
}

// holdState is the holder's answer about one exec (sandboxhelper/hold).
type holdState struct {
	Started  bool   `json:"started"`
	OutLen   int64  `json:"out_len"`
	ErrLen   int64  `json:"err_len"`
	Ended    bool   `json:"ended"`
	ExitCode *int   `json:"exit_code,omitempty"`
	Signal   string `json:"signal,omitempty"`
}

// counted counts what reaches w (the offsets to reattach from) and
// when the last of it came.
type counted struct {
	w    io.Writer
	n    atomic.Int64
	last atomic.Int64 // Unix nanoseconds
}

func (c *counted) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n.Add(int64(n))
	c.last.Store(time.Now().UnixNano())
	return n, err
}

func newExecID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// runHeld runs command under the helper's holder; when the connection is
// lost while it runs, it takes the lock on a new connection and reattaches
// from the bytes received, so the caller gets the rest of the output and
// the command's own exit code. The command is started once: after a loss
// it is never started again, even when the holder has no record of it.
func (m *Manager) runHeld(ctx context.Context, s *store.Session, lc *sshpool.Locked, helper string, stdio sshpool.Stdio, command string, stream backend.ExecStream) (sshpool.ExitStatus, error) {
	id := newExecID()
	// The waits of a reattach (the lock, the holder's answers) say what
	// they wait for, as the exec's first lock wait does.
	say := func(msg string) {
		_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecQueued, Message: msg})
		m.progress(s, ipc.PhaseWaiting, msg)
	}
	ctx = withLockProgress(ctx, say)
	out, errw := &counted{w: stdio.Stdout}, &counted{w: stdio.Stderr}
	stdio.Stdout, stdio.Stderr = out, errw
	bin := ".git/sandboxd/bin/" + helper
	// The caller's stdin goes in frames (hold's --stdin-frames): its end
	// is a frame, so a lost channel is no end of it and no request of its
	// own tells one. No stdin is an empty one, ended at once.
	src := stdio.Stdin
	if src == nil {
		src = eofReader{}
	}
	in := newStdinHandoff(src)
	defer in.close()
	stdio.Stdin = in.next()
	start := fmt.Sprintf("exec %s hold start %s --stdin-frames -- sh -c %s", bin, id, quoteArg(command, true))
	var st sshpool.ExitStatus
	var err error
	if r := m.sandboxOf(s).relays.For(lc.Conn, helper, m.relayIdle(), false); r != nil {
		// The relay's stdin reader ends with its exec; a start or an
		// attach that follows reads the caller's next bytes. Probed
		// from the request on: a relay channel still being opened on a
		// connection gone silent is found by the probes, not the
		// keepalives.
		stop := m.probeConn(ctx, lc.Conn, afterHeld)
		st, err = m.relayed(ctx, r, lc, id, command, stdio, func() { stdio.Stdin = in.next() })
		stop()
		if errors.Is(err, relay.ErrNotSent) {
			m.log.Debug("the relay did not take a held exec; starting it on its own channel", "run", s.RunID, "exec", id, "err", err)
			st, err = m.execProbing(ctx, lc, start, stdio, afterHeld)
		}
	} else {
		st, err = m.execProbing(ctx, lc, start, stdio, afterHeld)
	}
	if errors.Is(err, relay.ErrForged) {
		return st, errdefs.Unavailable(fmt.Errorf("%w: the command may still be running in the sandbox and was not run again; see it with `nook attach %s`", err, id))
	}
	began := time.Now().UnixNano()
	// Every reattach of this exec together is bounded: an agent that
	// refuses connections for long must not hold the caller for the lock's
	// bound (minutes) on each attempt.
	bound := m.reattachTimeout()
	var reattachBy time.Time
	for attempt := 0; attempt < reattachAttempts && err != nil && (errors.Is(err, sshpool.ErrConnectionLost) || errors.Is(err, relay.ErrLost)) && ctx.Err() == nil; attempt++ {
		// Silence gives no time of its own: the last byte received is the
		// best bound of when the connection went.
		lost := time.Unix(0, max(began, out.last.Load(), errw.last.Load()))
		// A relay that ended on a live connection (killed) leaves the
		// lock where it is: the attach runs on the same connection.
		relayLost := !errors.Is(err, sshpool.ErrConnectionLost)
		m.log.Info("the connection or the relay broke while a held command ran; reattaching", "run", s.RunID, "exec", id, "err", err)
		if reattachBy.IsZero() {
			reattachBy = time.Now().Add(bound)
		}
		if !relayLost {
			conn, lerr := m.relockBy(ctx, s, reattachBy, bound)
			if lerr != nil {
				return st, fmt.Errorf("%w; reattaching failed: %w", err, lerr)
			}
			lc.Conn = conn
		}
		// The lost exec's stdin relay may still wait for the caller's
		// next bytes: they go to the new attach instead.
		stdio.Stdin = in.next()
		hs, serr := m.holdState(ctx, lc, bin, id)
		if serr != nil {
			return st, fmt.Errorf("%w; asking the sandbox about the command failed: %w", err, serr)
		}
		if !hs.Started {
			// No record of the command: its start may not have arrived,
			// or the record was removed in the sandbox, which the command
			// itself can do. It may have run: never sent again. (err is
			// said, not wrapped: this report is not a lost connection's.)
			return st, errdefs.Unavailable(fmt.Errorf("%v; then the sandbox had no record of command %s: its start may not have arrived, or the record was removed in the sandbox; it may or may not have run, so it was not run again (check its effects before you run it again)", err, id))
		}
		line := fmt.Sprintf("exec %s hold attach %s %d %d --stdin-frames", bin, id, out.n.Load(), errw.n.Load())
		msg := fmt.Sprintf("the connection to the sandbox dropped for about %s (nothing came since); the command went on in the sandbox and is reattached", time.Since(lost).Round(100*time.Millisecond))
		if relayLost {
			msg = "the sandbox helper's relay ended while the command ran; the command went on in the sandbox and is reattached"
		}
		_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecWarning, Message: msg})
		st, err = m.execProbing(ctx, lc, line, stdio, afterHeld)
	}
	if err == nil && st.Signal == "" && st.Code > 128 && st.Code < 160 {
		// The holder reports a signal as 128+n; its state names it.
		if hs, serr := m.holdState(ctx, lc, bin, id); serr == nil {
			st = heldSignal(st, hs)
		} else {
			m.log.Debug("ask the holder how a command ended", "run", s.RunID, "exec", id, "err", serr)
		}
	}
	return st, err
}

// heldSignal is st with the signal the holder names in hs, when hs says
// the command ended by a signal this daemon knows and its number matches
// st's 128+n; st unchanged otherwise.
func heldSignal(st sshpool.ExitStatus, hs holdState) sshpool.ExitStatus {
	if !hs.Ended || hs.ExitCode == nil || *hs.ExitCode != st.Code {
		return st
	}
	if n, ok := sshpool.SignalNumber(hs.Signal); ok && 128+n == st.Code {
		return sshpool.ExitStatus{Code: st.Code, Signal: hs.Signal}
	}
	return st
}

// execProbing runs line on lc while probing its connection every
// probeEvery: a command may print nothing for long, and a connection that
// went silent under it is then found within the probe timeout, not at the
// keepalive timeout (a held command is then reattached, a plain one
// reported). A probe unanswered past sayAfter says so through ctx's lock
// progress; after is what happens once the probe timeout passes.
func (m *Manager) execProbing(ctx context.Context, lc *sshpool.Locked, line string, stdio sshpool.Stdio, after string) (sshpool.ExitStatus, error) {
	defer m.probeConn(ctx, lc.Conn, after)()
	return lc.Exec(ctx, line, stdio)
}

// probeConn probes conn every probeEvery until the returned stop is called,
// saying through ctx's lock progress when a probe goes unanswered past
// sayAfter, and what happens once the probe timeout passes (after); a
// probe that fails closes conn, so what runs on it ends with
// ErrConnectionLost.
func (m *Manager) probeConn(ctx context.Context, conn *sshpool.Conn, after string) (stop func()) {
	_, probeTimeout := m.waitBounds()
	done := make(chan struct{})
	say := lockProgress(ctx)
	go func() {
		for {
			select {
			case <-done:
				return
			case <-time.After(probeEvery):
			}
			sent := time.Now()
			// Said before the probe can fail, however short its timeout:
			// the exec may end on that failure.
			t := time.AfterFunc(min(sayAfter, probeTimeout/2), func() {
				select {
				case <-done:
				default:
					say(fmt.Sprintf("%s: no answer to a probe sent at %s; waiting up to %s (ssh_probe_timeout) for one, then %s", ipc.WaitingSilent, sent.Local().Format("15:04:05"), probeTimeout, after))
				}
			})
			err := conn.Probe(ctx, probeTimeout)
			t.Stop()
			if err != nil {
				return // closed: the exec below ends with ErrConnectionLost
			}
		}
	}()
	return func() { close(done) }
}

// holdState asks the holder about exec id on lc. The holder reads two
// small files: it answers within a probe's time plus the start of a
// process, or it is stuck (or not the holder) and the reattach ends.
func (m *Manager) holdState(ctx context.Context, lc *sshpool.Locked, bin, id string) (holdState, error) {
	_, probeTimeout := m.waitBounds()
	bound := probeTimeout + helperStartSlack
	var buf bytes.Buffer
	w := &limitWriter{w: &buf, left: maxHoldState}
	var st sshpool.ExitStatus
	err := helperWait(ctx, "answer about the held command", bound, func(ctx context.Context) (err error) {
		st, err = lc.Exec(ctx, fmt.Sprintf("exec %s hold state %s", bin, id), sshpool.Stdio{Stdout: w})
		return err
	})
	if err != nil {
		return holdState{}, err
	}
	if st.Code != 0 || w.over {
		return holdState{}, errdefs.Unavailable(fmt.Errorf("the holder's state answer was refused or too long (exit %d)", st.Code))
	}
	var hs holdState
	if err := json.Unmarshal(buf.Bytes(), &hs); err != nil {
		return holdState{}, fmt.Errorf("the holder's state answer is unreadable: %w", err)
	}
	if hs.OutLen < 0 || hs.ErrLen < 0 {
		return holdState{}, errors.New("the holder's state answer has negative lengths")
	}
	return hs, nil
}

// limitWriter keeps up to left bytes and notes what was over.
type limitWriter struct {
	w    io.Writer
	left int
	over bool
}

func (l *limitWriter) Write(p []byte) (int, error) {
	n := len(p)
	if n > l.left {
		l.over = true
		p = p[:l.left]
	}
	l.left -= len(p)
	_, _ = l.w.Write(p)
	return n, nil
}

// stdinHandoff hands the caller's stdin to one attach after another, in
// hold's frames: a single pump reads it, and the reader of an attach that
// was replaced ends (EOF, no end frame) instead of taking bytes meant for
// the next. Bytes the lost attach had already sent may be lost with its
// channel.
type stdinHandoff struct {
	src  io.Reader
	once sync.Once
	data chan []byte
	done chan struct{}
	mu   sync.Mutex
	rest []byte        // a chunk's unsent part, for whichever reader is current
	gone chan struct{} // closed when the current reader is replaced
}

// frameHeader is the length prefix of a stdin frame; maxStdinFrame
// bounds one (hold's own bound is larger).
const (
	frameHeader   = 4
	maxStdinFrame = 32 << 10
)

type eofReader struct{}

func (eofReader) Read([]byte) (int, error) { return 0, io.EOF }

func newStdinHandoff(src io.Reader) *stdinHandoff {
	return &stdinHandoff{src: src, data: make(chan []byte), done: make(chan struct{})}
}

// next ends the current reader and returns the next attach's.
func (h *stdinHandoff) next() io.Reader {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.gone != nil {
		close(h.gone)
	}
	h.gone = make(chan struct{})
	return &handoffReader{h: h, gone: h.gone}
}

// close stops the pump (the exec is over).
func (h *stdinHandoff) close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	select {
	case <-h.done:
	default:
		close(h.done)
	}
}

func (h *stdinHandoff) pump() {
	defer close(h.data)
	for {
		buf := make([]byte, maxStdinFrame)
		n, err := h.src.Read(buf)
		if n > 0 {
			select {
			case h.data <- buf[:n]:
			case <-h.done:
				return
			}
		}
		if err != nil {
			return
		}
	}
}

type handoffReader struct {
	h     *stdinHandoff
	gone  chan struct{}
	ended bool // the end frame was sent
}

// frame puts as much of b as fits in p as one frame; the rest is kept.
func (r *handoffReader) frame(p, b []byte) int {
	n := min(len(b), len(p)-frameHeader)
	binary.BigEndian.PutUint32(p, uint32(n))
	copy(p[frameHeader:], b[:n])
	r.h.rest = append(r.h.rest[:0:0], b[n:]...)
	return frameHeader + n
}

func (r *handoffReader) Read(p []byte) (int, error) {
	if len(p) <= frameHeader {
		return 0, io.ErrShortBuffer
	}
	h := r.h
	if r.ended {
		return 0, io.EOF
	}
	h.once.Do(func() { go h.pump() })
	h.mu.Lock()
	select {
	case <-r.gone:
		h.mu.Unlock()
		return 0, io.EOF
	default:
	}
	if len(h.rest) > 0 {
		defer h.mu.Unlock()
		return r.frame(p, h.rest), nil
	}
	h.mu.Unlock()
	select {
	case <-r.gone:
		return 0, io.EOF
	case b, ok := <-h.data:
		h.mu.Lock()
		defer h.mu.Unlock()
		select {
		case <-r.gone:
			// Replaced while it waited: the bytes are the next reader's
			// (a closed pump stays closed for it too).
			h.rest = append(b, h.rest...)
			return 0, io.EOF
		default:
		}
		if !ok {
			// The caller's stdin ended: the empty frame says so.
			r.ended = true
			binary.BigEndian.PutUint32(p, 0)
			return frameHeader, nil
		}
		return r.frame(p, b), nil
	}
}

// helperStartSlack is the time a helper process in the sandbox may take to
// start, on top of a round trip.
const helperStartSlack = 2 * time.Second

// helperWait runs ask, a question to the sandbox helper, for at most
// bound; past sayAfter it says what it waits for through ctx's lock
// progress (stderr, session.progress, MCP progress). Past the bound it
// fails with a message saying what to do.
func helperWait(ctx context.Context, what string, bound time.Duration, ask func(context.Context) error) error {
	say := lockProgress(ctx)
	since := time.Now()
	actx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	t := time.AfterFunc(sayAfter, func() {
		say(fmt.Sprintf("%s to %s since %s", ipc.WaitingHelper, what, since.Local().Format("15:04:05")))
	})
	err := ask(actx)
	t.Stop()
	if err != nil && ctx.Err() == nil && actx.Err() != nil {
		return errdefs.Unavailable(fmt.Errorf("the sandbox helper did not %s within %s (is the sandbox overloaded, or was the helper replaced?): the command may still be running in the sandbox; see it with `nook exec -- ps -ef`, or `nook reset` for a fresh sandbox: %w", what, bound, err))
	}
	return err
}

package sessions

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"sync/atomic"
	"time"

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

// maxHoldState bounds the answer of `hold state`.
const maxHoldState = 4 << 10

var helperFile = regexp.MustCompile(`^[a-z-]+-[0-9a-f]{16}$`)

// holderOn is the sandbox helper's file name on conn when it can hold a
// command, "" when not.
func (m *Manager) holderOn(conn *sshpool.Conn) string {
	m.mu.Lock()
	on := m.daemonCfg.DurableExec
	m.mu.Unlock()
	if !on || m.opts.SyncHelper == nil {
		return ""
	}
	name, inst := m.opts.SyncHelper(conn)
	if inst == "" || !helperFile.MatchString(name) {
		return ""
	}
	return name
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
// it is started again only if the holder never heard of it.
func (m *Manager) runHeld(ctx context.Context, s *store.Session, lc *lockedConn, helper string, stdio sshpool.Stdio, command string, stream backend.ExecStream) (sshpool.ExitStatus, error) {
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
	var current atomic.Pointer[sshpool.Conn]
	current.Store(lc.conn)
	if stdio.Stdin != nil {
		// The end of the caller's stdin is told on a request of its own: a
		// lost channel ends the holder's stdin too.
		stdio.Stdin = &eofTeller{r: stdio.Stdin, tell: func() {
			tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), unlockTimeout)
			defer cancel()
			if _, err := current.Load().ExecOnce(tctx, fmt.Sprintf("exec %s hold eof %s", bin, id), sshpool.Stdio{}); err != nil {
				m.log.Debug("tell a held command its stdin ended", "run", s.RunID, "err", err)
			}
		}}
	}
	start := fmt.Sprintf("exec %s hold start %s -- sh -c %s", bin, id, quoteArg(command, true))
	st, err := m.execProbing(ctx, lc, start, stdio)
	began := time.Now().UnixNano()
	for attempt := 0; attempt < reattachAttempts && err != nil && errors.Is(err, sshpool.ErrConnectionLost) && ctx.Err() == nil; attempt++ {
		// Silence gives no time of its own: the last byte received is the
		// best bound of when the connection went.
		lost := time.Unix(0, max(began, out.last.Load(), errw.last.Load()))
		m.log.Info("the connection broke while a held command ran; reattaching", "run", s.RunID, "exec", id, "err", err)
		conn, lerr := m.relock(ctx, s)
		if lerr != nil {
			return st, fmt.Errorf("%w; reattaching failed: %w", err, lerr)
		}
		lc.conn = conn
		current.Store(conn)
		hs, serr := m.holdState(ctx, lc, bin, id)
		if serr != nil {
			return st, fmt.Errorf("%w; asking the sandbox about the command failed: %w", err, serr)
		}
		line := fmt.Sprintf("exec %s hold attach %s %d %d", bin, id, out.n.Load(), errw.n.Load())
		if !hs.Started {
			// The start never reached the sandbox: it runs now, once.
			line = start
		}
		msg := fmt.Sprintf("the connection to the sandbox dropped for about %s (nothing came since); the command went on in the sandbox and is reattached", time.Since(lost).Round(100*time.Millisecond))
		_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecWarning, Message: msg})
		st, err = m.execProbing(ctx, lc, line, stdio)
	}
	return st, err
}

// execProbing runs line on lc while probing its connection every
// probeEvery: a held command may print nothing for long, and a connection
// that went silent under it is then found within the probe timeout, not
// at the keepalive timeout, and the command reattached.
func (m *Manager) execProbing(ctx context.Context, lc *lockedConn, line string, stdio sshpool.Stdio) (sshpool.ExitStatus, error) {
	_, probeTimeout := m.waitBounds()
	done := make(chan struct{})
	defer close(done)
	conn := lc.conn
	go func() {
		for {
			select {
			case <-done:
				return
			case <-time.After(probeEvery):
			}
			if conn.Probe(ctx, probeTimeout) != nil {
				return // closed: the exec below ends with ErrConnectionLost
			}
		}
	}()
	return lc.exec(ctx, line, stdio)
}

// holdState asks the holder about exec id on lc. The holder reads two
// small files: it answers within a probe's time plus the start of a
// process, or it is stuck (or not the holder) and the reattach ends.
func (m *Manager) holdState(ctx context.Context, lc *lockedConn, bin, id string) (holdState, error) {
	_, probeTimeout := m.waitBounds()
	bound := probeTimeout + helperStartSlack
	var buf bytes.Buffer
	w := &limitWriter{w: &buf, left: maxHoldState}
	var st sshpool.ExitStatus
	err := helperWait(ctx, "answer about the held command", bound, func(ctx context.Context) (err error) {
		st, err = lc.exec(ctx, fmt.Sprintf("exec %s hold state %s", bin, id), sshpool.Stdio{Stdout: w})
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

// eofTeller reads r and calls tell when it ends.
type eofTeller struct {
	r    io.Reader
	tell func()
}

func (e *eofTeller) Read(p []byte) (int, error) {
	n, err := e.r.Read(p)
	if err == io.EOF {
		e.tell()
	}
	return n, err
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

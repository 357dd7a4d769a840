package relay

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"time"

	"github.com/sandboxd/sandboxd/daemon/gitsync"
	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// Exchanges runs held exchanges through a slot's relay on the locked
// connection (gitsync.ExchangeRunner): the helper's side runs in the
// relay's process.
type Exchanges struct {
	Slot   *Slot
	Lock   *sshpool.Locked
	Helper string
	// Idle is how long the relay stays open after the exchange;
	// SignalTimeout bounds a `hold signal` exec.
	Idle, SignalTimeout time.Duration
}

// RunExchange runs x on the relay when it is up, idle and said it serves
// (taken false otherwise, nothing read): its opening in the request, the
// exchange's frames on stdin as the relay's stdin frames, its answers to
// stdout, the helper's messages to stderr. A relay that ended (killed)
// while the exchange ran, its connection fine, is an exec that ended
// without a status: the exchange's own rules (a reattach) follow.
func (e Exchanges) RunExchange(ctx context.Context, x gitsync.RelayedExchange, stdin io.Reader, stdout, stderr io.Writer) (int, bool, error) {
	conn := e.Lock.Conn
	r := e.Slot.For(conn, e.Helper, e.Idle, true)
	if r == nil {
		return 0, false, nil
	}
	call := Call{
		Req:   helperproto.RelayRequest{ID: newID(), Exchange: true, Setup: x.Setup, SetupDone: x.SetupDone},
		First: inFrames(x.Opening),
		Feed:  func(w io.Writer) { feedRaw(w, stdin) },
		CutStdin: func() {
			if c, ok := stdin.(io.Closer); ok {
				_ = c.Close()
			}
		},
		Stdout: stdout, Stderr: stderr, Hold: x.Hold,
		SignalTimeout: e.SignalTimeout, Idle: e.Idle,
	}
	st, err := r.Run(ctx, call)
	switch {
	case errors.Is(err, ErrNotSent):
		r.log.Debug("the relay did not take an exchange; it runs on its own channel", "run", conn.RunID(), "err", err)
		return 0, false, nil
	case errors.Is(err, ErrLost):
		return -1, true, nil
	case err != nil:
		return -1, true, err
	}
	return st.Code, true, nil
}

// maxInFrame bounds the stdin frames sent to the relay (its own bound).
const maxInFrame = 32 << 10

// inFrames is p as the relay's 'i' frames, each within its bound (a
// larger one would be dropped, and the exchange wait for its request).
func inFrames(p []byte) []byte {
	var b []byte
	for len(p) > 0 {
		k := min(len(p), maxInFrame)
		b = helperproto.AppendHoldFrame(b, helperproto.HoldIn, p[:k])
		p = p[k:]
	}
	return b
}

// feedRaw copies src to the relay as its 'i' frames, and its end as 'z',
// until src or the relay ends.
func feedRaw(w io.Writer, src io.Reader) {
	buf := make([]byte, maxInFrame)
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

func newID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

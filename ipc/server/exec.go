package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// Exec stream buffering: stdin frames are queued so that a signal frame
// behind them is not stuck while the command is not reading its stdin.
const (
	stdinQueueFrames  = 64
	signalQueueFrames = 16
)

// postExec serves POST /v1/exec: a full-duplex NDJSON exchange. The request
// body is an ExecRequest followed by ExecInput frames; the response is
// ExecOutput frames ending with exit or error, as NDJSON or, when the
// request asks (ipc.HeaderExecFrames), as binary frames that carry output
// without base64. Until the first frame is
// written, a failure is answered as an ordinary JSON error with its status.
func (s *Server) postExec(w http.ResponseWriter, r *http.Request) error {
	if err := noQuery(r); err != nil {
		return err
	}
	rc := http.NewResponseController(w)
	// Without full duplex, net/http's HTTP/1 server closes the request body
	// once the response has started, which would cut stdin and signals.
	if err := rc.EnableFullDuplex(); err != nil {
		return errdefs.Internal(fmt.Errorf("enable full-duplex streaming: %w", err))
	}
	in := &frameLimitReader{r: r.Body, limit: s.maxBody}
	dec := json.NewDecoder(in)
	dec.DisallowUnknownFields()
	var req ipc.ExecRequest
	// The request line must come promptly; what follows (stdin, signals)
	// may rightly be quiet for as long as the command runs.
	_ = rc.SetReadDeadline(time.Now().Add(s.bodyIdle))
	if err := dec.Decode(&req); err != nil {
		if errors.Is(err, io.EOF) {
			return errdefs.Invalidf("the request body is empty: send an ExecRequest JSON object, then optional input frames")
		}
		if isTimeout(err) {
			return errdefs.Timeout(fmt.Errorf("the exec request did not arrive within %s: send the ExecRequest line at once", s.bodyIdle))
		}
		return jsonError(err)
	}
	_ = rc.SetReadDeadline(time.Time{})
	if err := req.Validate(); err != nil {
		return err
	}
	b, err := s.sessions()
	if err != nil {
		return err
	}
	defer s.trackStream()()

	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	st := newExecStream(ctx, w, rc, req.Stdin, s.log)
	st.binary = r.Header.Get(ipc.HeaderExecFrames) == ipc.ExecFramesBinary
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		st.readInput(dec, in, cancel)
	}()

	res, execErr := b.Exec(ctx, req, st)
	if execErr != nil {
		// An input error (a malformed frame) is what cancelled the exec:
		// report it rather than the cancellation it caused.
		if cause := context.Cause(ctx); cause != nil && errdefs.KindOf(cause) == errdefs.KindInvalid {
			execErr = cause
		}
		if !st.commandStarted() && retryMayHelp(execErr) {
			// Whoever reads the error must know whether to look for the
			// command's effects: before "started" nothing was run, so
			// running it again cannot run it twice.
			execErr = fmt.Errorf("%w (the command did not run, so it is safe to retry)", execErr)
		}
	}
	started := st.finish(res, execErr)

	// A streaming client ends its request once it has the final frame. Give
	// it a moment to: if the response ended first, its HTTP transport would
	// stall (net/http waits 50ms for the request write before it reuses or
	// drops the connection), and every exec would pay for it. An error
	// before the first frame has sent the client nothing to end on: it
	// is answered at once.
	if execErr == nil || started {
		select {
		case <-readDone:
		case <-time.After(inputDrainWait):
		}
	}
	// The input reader may be blocked on a body the client keeps open
	// (an interactive stdin): unblock it, as no handler may touch the body
	// after returning. Only then: a read deadline set after the body ended
	// fails net/http's background read of the kept-alive connection, which
	// cancels the context of every later request on it.
	cancel(errExecOver)
	select {
	case <-readDone:
	default:
		_ = rc.SetReadDeadline(time.Now())
		<-readDone
	}
	if execErr != nil && !started {
		return execErr
	}
	if execErr != nil {
		s.log.Debug("exec failed after it started streaming", "err", execErr)
	}
	return nil
}

var errExecOver = errors.New("the exec is over")

// inputDrainWait bounds how long a finished exec waits for the client to end
// its request stream.
const inputDrainWait = time.Second

// execStream implements ExecStream over one request/response pair.
type execStream struct {
	ctx context.Context
	w   http.ResponseWriter
	rc  *http.ResponseController
	log *slog.Logger

	// binary: the client asked for binary frames (ipc.HeaderExecFrames).
	binary bool

	stdin   io.Reader
	stdinCh chan []byte // nil when the request has no stdin
	signals chan string
	resizes chan ipc.WindowSize // the latest size wins

	mu         sync.Mutex
	cmdStarted bool // the started frame was sent: the command may run
	started    bool // a frame (and so the 200 header) was written
	done       bool // the final frame was written; no more writes
	werr       error
}

func newExecStream(ctx context.Context, w http.ResponseWriter, rc *http.ResponseController, withStdin bool, log *slog.Logger) *execStream {
	st := &execStream{ctx: ctx, w: w, rc: rc, log: log, signals: make(chan string, signalQueueFrames), resizes: make(chan ipc.WindowSize, 1)}
	if withStdin {
		st.stdinCh = make(chan []byte, stdinQueueFrames)
		st.stdin = &chanReader{ctx: ctx, ch: st.stdinCh}
	} else {
		st.stdin = strings.NewReader("")
	}
	return st
}

func (st *execStream) Stdin() io.Reader       { return st.stdin }
func (st *execStream) Stdout() io.Writer      { return frameWriter{st, ipc.ExecStdout} }
func (st *execStream) Stderr() io.Writer      { return frameWriter{st, ipc.ExecStderr} }
func (st *execStream) Signals() <-chan string { return st.signals }

// Resizes yields the caller's terminal sizes (an exec with a TTY); a size
// not taken yet is replaced by a newer one. It is closed with Signals.
func (st *execStream) Resizes() <-chan ipc.WindowSize { return st.resizes }

func (st *execStream) Send(f ipc.ExecOutput) error {
	switch f.Type {
	case ipc.ExecQueued, ipc.ExecStarted, ipc.ExecWarning:
	default:
		return fmt.Errorf("exec stream: Send takes queued, started or warning frames, not %q", f.Type)
	}
	if f.Type == ipc.ExecStarted {
		st.mu.Lock()
		st.cmdStarted = true
		st.mu.Unlock()
	}
	return st.write(f, false)
}

func (st *execStream) commandStarted() bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.cmdStarted
}

var errStreamDone = errors.New("the exec stream is closed")

// write sends one frame and flushes it. The first frame commits the 200
// header. A failed write means the client is gone.
func (st *execStream) write(f ipc.ExecOutput, final bool) error {
	var head, payload []byte
	switch {
	case st.binary && (f.Type == ipc.ExecStdout || f.Type == ipc.ExecStderr):
		kind := ipc.FrameStdout
		if f.Type == ipc.ExecStderr {
			kind = ipc.FrameStderr
		}
		if len(f.Data) > ipc.MaxFramePayload {
			// One frame a piece: a reader refuses longer ones.
			for p := f.Data; len(p) > 0; {
				n := min(len(p), ipc.MaxFramePayload)
				if err := st.write(ipc.ExecOutput{Type: f.Type, Data: p[:n]}, false); err != nil {
					return err
				}
				p = p[n:]
			}
			return nil
		}
		head, payload = ipc.AppendFrameHead(nil, kind, len(f.Data)), f.Data
	default:
		b, err := json.Marshal(f)
		if err != nil {
			return fmt.Errorf("encode exec frame: %w", err)
		}
		if st.binary {
			head, payload = ipc.AppendFrameHead(nil, ipc.FrameControl, len(b)), b
		} else {
			payload = append(b, '\n')
		}
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.done {
		return errStreamDone
	}
	if st.werr != nil {
		return st.werr
	}
	if final {
		st.done = true
	}
	if !st.started {
		ct := ipc.ContentTypeNDJSON
		if st.binary {
			ct = ipc.ContentTypeExecFrames
		}
		st.w.Header().Set("Content-Type", ct)
		st.w.Header().Set("X-Content-Type-Options", "nosniff")
		st.w.WriteHeader(http.StatusOK)
		st.started = true
	}
	if head != nil {
		if _, err := st.w.Write(head); err != nil {
			st.werr = fmt.Errorf("write to the client: %w", err)
			return st.werr
		}
	}
	if _, err := st.w.Write(payload); err != nil {
		st.werr = fmt.Errorf("write to the client: %w", err)
		return st.werr
	}
	if err := st.rc.Flush(); err != nil {
		st.werr = fmt.Errorf("flush to the client: %w", err)
		return st.werr
	}
	return nil
}

// finish writes the final frame unless the failure can still be answered
// as a plain JSON error, and reports whether the stream had started.
func (st *execStream) finish(res ipc.ExecResult, err error) (started bool) {
	st.mu.Lock()
	started = st.started
	if err != nil && !started {
		st.done = true // the handler answers with a JSON error
	}
	st.mu.Unlock()
	if err != nil && !started {
		return false
	}
	if err != nil {
		d := errorDetailOf(err)
		_ = st.write(ipc.ExecOutput{Type: ipc.ExecError, Error: &d}, true)
		return true
	}
	if res.PulledFiles == nil {
		res.PulledFiles = []string{}
	}
	_ = st.write(ipc.ExecOutput{Type: ipc.ExecExit, Result: &res}, true)
	return true
}

// readInput decodes input frames until the body ends, feeding stdin and
// signals. A broken body (the client went away) cancels the exec; a
// malformed frame cancels it with an Invalid error.
func (st *execStream) readInput(dec *json.Decoder, in *frameLimitReader, cancel context.CancelCauseFunc) {
	defer close(st.signals)
	defer close(st.resizes)
	stdinOpen := st.stdinCh != nil
	closeStdin := func() {
		if stdinOpen {
			close(st.stdinCh)
			stdinOpen = false
		}
	}
	defer closeStdin()
	for frame := 1; ; frame++ {
		in.reset()
		var f ipc.ExecInput
		err := dec.Decode(&f)
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			if st.ctx.Err() != nil {
				return
			}
			var tooLarge *http.MaxBytesError
			if errors.As(err, &tooLarge) || (in.readErr == nil && !errors.Is(err, io.ErrUnexpectedEOF)) {
				cancel(errdefs.Invalidf("exec input frame %d: %v", frame, jsonError(err)))
				return
			}
			cancel(errdefs.Canceled(fmt.Errorf("the client went away: %w", err)))
			return
		}
		if f.Signal != "" {
			if !ipc.ValidSignal(f.Signal) {
				cancel(errdefs.Invalidf("exec input frame %d: unknown signal %q: use a name such as INT, TERM, HUP, QUIT or KILL", frame, f.Signal))
				return
			}
			select {
			case st.signals <- f.Signal:
			default:
				st.log.Warn("dropped a signal: the command is not taking signals", "signal", f.Signal)
			}
		}
		if f.Resize != nil {
			if err := f.Resize.Validate(); err != nil {
				cancel(errdefs.Invalidf("exec input frame %d: %v", frame, err))
				return
			}
			select {
			case <-st.resizes: // drop a size nobody took
			default:
			}
			st.resizes <- *f.Resize
		}
		if len(f.Stdin) > 0 && stdinOpen {
			select {
			case st.stdinCh <- f.Stdin:
			case <-st.ctx.Done():
				return
			}
		}
		if f.StdinEOF {
			closeStdin()
		}
	}
}

// frameWriter turns each Write into one stdout or stderr frame.
type frameWriter struct {
	st  *execStream
	typ string
}

func (fw frameWriter) Write(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if err := fw.st.write(ipc.ExecOutput{Type: fw.typ, Data: p}, false); err != nil {
		return 0, err
	}
	return len(p), nil
}

// chanReader reads stdin chunks from a channel.
type chanReader struct {
	ctx  context.Context
	ch   <-chan []byte
	rest []byte
}

func (c *chanReader) Read(p []byte) (int, error) {
	for len(c.rest) == 0 {
		select {
		case b, ok := <-c.ch:
			if !ok {
				return 0, io.EOF
			}
			c.rest = b
		case <-c.ctx.Done():
			return 0, context.Cause(c.ctx)
		}
	}
	n := copy(p, c.rest)
	c.rest = c.rest[n:]
	return n, nil
}

// frameLimitReader bounds the bytes read for one frame of a stream; the
// limit restarts at each frame. The JSON decoder reads ahead, so the bound
// is approximate by at most one read.
type frameLimitReader struct {
	r       io.Reader
	limit   int64
	n       int64
	readErr error // the connection's error, as opposed to bad JSON
}

func (f *frameLimitReader) reset() { f.n = 0 }

func (f *frameLimitReader) Read(p []byte) (int, error) {
	if f.n > f.limit {
		return 0, &http.MaxBytesError{Limit: f.limit}
	}
	n, err := f.r.Read(p)
	f.n += int64(n)
	if err != nil && !errors.Is(err, io.EOF) {
		f.readErr = err
	}
	return n, err
}

// retryMayHelp says whether running the same exec again may succeed: after
// a transient failure, a conflict or a sandbox that ended, yes; not when
// the request itself is wrong (not a repository, no commits, no config),
// refused, too large, or the disk is full.
func retryMayHelp(err error) bool {
	var noRetry interface{ NoRetryHint() bool }
	if errors.Is(err, syscall.ENOSPC) || errors.As(err, &noRetry) && noRetry.NoRetryHint() {
		return false
	}
	switch errdefs.KindOf(err) {
	case errdefs.KindUnavailable, errdefs.KindTimeout, errdefs.KindCanceled, errdefs.KindConflict, errdefs.KindGone:
		return true
	}
	return false
}

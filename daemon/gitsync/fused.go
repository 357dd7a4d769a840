package gitsync

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// MaxFusedPatch bounds the helper's push entries (file contents) that
// travel in an exchange's request; larger changes travel as the patch
// alone, which the request carries up to the patch limit.
const MaxFusedPatch = 48 << 10

// maxHelperLog bounds what is kept of the helper's own messages (the
// exchange's stderr), which are logged, never read as control.
const maxHelperLog = 16 << 10

// Exchange is one synced exec in one exec request to the sandbox helper
// (`sandboxd-helper exchange`, protocol in package helperproto), so one
// round trip: push, the user's command with the caller's streams, pull.
// A held one runs instead in the process of the connection's relay when
// the Runner is an ExchangeRunner that takes it: the same frames, no exec
// request.
// The request and the caller's stdin and signals travel as frames on the
// exec's stdin; the helper's answers as frames on its stdout, which the
// command never writes (it has pipes of its own, and the helper is not
// dumpable). Exchange reads and checks every answer frame:
//
//   - Every frame must carry its tag under the key of this exchange's
//     hello and request (helperproto.AnswerKey): a frame another process
//     wrote into the channel ends the exchange with ErrForgedReport (never
//     the separate steps, so the command is not sent twice).
//   - HelloAnswer first: an unknown version, or no answer from an exec
//     that failed (exit 1..127: no helper, a failed prelude), means the
//     helper did not take the exchange (Fused.Split: separate steps). No
//     answer from an exec that exited 0 or by a signal is an answer lost
//     on the way: the command may have run (error, not run again).
//   - Declined, or PushFailed after the push's output: nothing ran. Both
//     are believed only before Started; after it, the exchange ends with
//     ErrForgedReport and the command is not run again.
//   - Started, then the command's stdout and stderr (each frame's offset
//     must be the count received so far), Exit (a code 0..255 or a signal
//     name), the pull's output and PullEnd, End.
//
// The exec's own exit status carries nothing: a stream that ends after
// Started without Exit is a command whose status is unknown (error, not
// run again), unless the command is held (the request's hold id): then
// Reattach follows it on a new connection, by its id only.
type Exchange struct {
	s     *Syncer
	rp    repo
	p     *Patch
	pend  string
	start time.Time
	// commit: the head was pushed with git's protocol first.
	commit  bool
	inst    string
	command string
	// setup is what command does before the helper, for a relay that
	// runs the helper's side (ExchangeRunner).
	setup string
	req   []byte
	// key is what tags the helper's answers (helperproto.AnswerKey).
	key []byte
	// hold is the exec id under which the helper's holder runs the
	// command; remote, pullReq and the stdin pump serve
	// a Reattach.
	hold string
	reqv helperproto.ExchangeRequest
	// pushIn makes the push script of an early request's Patch frame.
	pushIn  exchangeInput
	remote  string
	pullReq helperproto.ExchangeRequest
	inOnce  sync.Once
	in      chan []byte
	inOff   int64

	mu         sync.Mutex
	a          answers
	reattached bool
	// opening makes a reattach's opening frames and key (marshalOpening;
	// tests see the key through it).
	opening func(typ byte, v any) ([]byte, []byte, error)
}

// ExchangeIO are the caller's streams: its stdin (nil for none), the
// command's stdout and stderr, and the signals for the command (SSH names
// without "SIG").
type ExchangeIO struct {
	Stdin          io.Reader
	Stdout, Stderr io.Writer
	Signals        <-chan string
}

// answers is what the helper said.
type answers struct {
	hello     bool
	version   int
	declined  *helperproto.Declined
	pushFail  *helperproto.PushFailed
	started   *helperproto.Started
	exit      *helperproto.Exit
	pullEnd   *helperproto.PullEnd
	end       bool
	pull      limitedBuffer
	out, errn int64
	// err is the first protocol violation; it ends the exchange.
	err error
	// code is the exec's exit status as a shell reports it (128+n for
	// signal n), -1 when the transport gave none.
	code int
	log  limitedBuffer
}

// Fused is what a fused exchange did.
type Fused struct {
	// Ran says the user's command ran; ExitCode is then its status, and
	// Signal the signal that ended it ("" for none; ExitCode is 128+n).
	Ran      bool
	ExitCode int
	Signal   string
	Push     PushResult
	// Pull is the pull of the command's edits; PullErr says it failed (the
	// sandbox keeps the edits and the next exec brings them back).
	Pull    PullResult
	PullErr error
	// Native says the sandbox helper knew the working tree after the push
	// (it moved it, or adopted the tree the plain way made), so it looked
	// for the command's edits itself (see sandboxhelper).
	Native bool
	// Again says the command did not run because the push found something
	// to do first (edits of an earlier exec brought back, a commit pushed):
	// prepare and exchange again.
	Again bool
	// Split says the helper did not take the exchange (it is missing, did
	// not answer, speaks another version or declined): nothing ran; take
	// the separate steps.
	Split bool
}

// Fuse returns the exchange that runs command (a shell command line for the
// sandbox's /bin/sh) synced with p through the sandbox helper. ok is false
// when no helper serves on r's connection: the caller then takes the
// separate steps (Push, the command, Pull). When the sandbox may lack p's head commit, it is
// pushed first with git's protocol (one more round trip, only when HEAD
// moved).
func (s *Syncer) Fuse(ctx context.Context, r Runner, p *Patch, command string) (*Exchange, bool, error) {
	if err := s.checkPatch(p); err != nil {
		return nil, false, err
	}
	rp, err := s.openRepo(ctx, p.RepoRoot)
	if err != nil {
		return nil, false, repoError(err)
	}
	// The side is picked once: the instance the exchange is for is the
	// one its request names.
	pend := newID()
	sd := sideOf(r)
	in := exchangeInput{p: p, pend: pend, acks: s.acks(rp), now: s.now(), max: s.maxBytes}
	remote, req, ok := sd.exchange(in, command)
	if !ok {
		return nil, false, nil
	}
	x := &Exchange{s: s, rp: rp, p: p, pend: pend, start: time.Now(), inst: req.Instance, command: remote, hold: holdID(), pushIn: in}
	if h, ok := sd.(helperSide); ok {
		x.remote = prelude + h.becomeHelper()
		x.setup = h.relaySetup()
	}
	var res PushResult
	if err := s.pushCommitsIfNeeded(ctx, r, rp, p, &res); err != nil {
		return nil, false, err
	}
	x.commit = res.Commits
	req.Hold, req.Forget = x.hold, s.takeEnded(rp.root)
	x.pullReq = helperproto.ExchangeRequest{Instance: req.Instance, Pending: pend, Max: s.maxBytes, DiffArgs: diffOptions, PullScript: req.PullScript}
	if x.req, x.key, err = marshalRequest(req); err != nil {
		return nil, false, err
	}
	x.reqv = req
	return x, true, nil
}

// marshalRequest is the hello and the request frames, and the key of the
// answers' tags: a fresh nonce the hello carries, bound to the request.
func marshalRequest(req helperproto.ExchangeRequest) ([]byte, []byte, error) {
	return marshalOpening(helperproto.FrameRequest, req)
}

// marshalOpening is the hello and the frame typ of v (a request or a
// reattach), and the key of the answers' tags.
func marshalOpening(typ byte, v any) ([]byte, []byte, error) {
	nonce := make([]byte, helperproto.NonceSize)
	if _, err := rand.Read(nonce); err != nil {
		return nil, nil, fmt.Errorf("make the exchange's nonce: %w", err)
	}
	body, err := json.Marshal(v)
	if err != nil {
		return nil, nil, err
	}
	var b bytes.Buffer
	fw := &helperproto.FrameWriter{W: &b}
	if err := fw.JSON(helperproto.FrameHello, helperproto.Hello{Versions: []int{helperproto.Version}, Nonce: nonce}); err != nil {
		return nil, nil, err
	}
	if err := fw.Write(typ, body); err != nil {
		return nil, nil, err
	}
	if b.Len() > helperproto.MaxRequest {
		return nil, nil, errdefs.TooLarge(fmt.Errorf("the exchange's request is %s, over the %s a request may carry", formatBytes(int64(b.Len())), formatBytes(helperproto.MaxRequest)))
	}
	return b.Bytes(), helperproto.AnswerKey(nonce, body), nil
}

// Command is the remote command of the exchange.
func (x *Exchange) Command() string { return x.command }

// Run runs the exchange on r with the caller's streams. An error is the
// transport's (the connection broke, ctx ended) or the helper's answer
// breaking the protocol; Finish says what happened either way.
func (x *Exchange) Run(ctx context.Context, r Runner, cio ExchangeIO) error {
	return x.run(ctx, r, cio, x.command, x.req, x.p.early != nil, x.hold != "")
}

// ErrReattach: a reattach to a held command failed; the command may still
// run in the sandbox, and it is never started again.
var ErrReattach = errors.New("reattaching to the command failed")

// Reattach follows the held command of an exchange whose connection was
// lost after Started and before Exit, on r's new connection (under the
// lock): the rest of its output from the bytes received, its exit, then
// the pull, as Run would have. The request asks only for an id the daemon
// chose; a decline, another version or garbage ends the exchange
// (ErrReattach or ErrForgedReport), and nothing asks for the command to
// run again. Finish then completes it as after Run.
func (x *Exchange) Reattach(ctx context.Context, r Runner, cio ExchangeIO) error {
	x.mu.Lock()
	if x.a.started == nil || x.a.exit != nil || x.a.err != nil || x.hold == "" {
		x.mu.Unlock()
		return fmt.Errorf("%w: the exchange is not a held command that is running", ErrReattach)
	}
	tree := ""
	if x.a.started.Native {
		tree = x.a.started.Tree
	}
	ra := helperproto.Reattach{Hold: x.hold, Out: x.a.out, Err: x.a.errn, Tree: tree, Request: x.pullReq}
	// The new helper says hello again; the rest (started, offsets) holds.
	x.a.hello, x.a.version, x.reattached = false, 0, true
	// A new nonce: the new helper's answers are tagged under a key of
	// their own, from the first frame (seq 0) on.
	opening := x.opening
	if opening == nil {
		opening = marshalOpening
	}
	b, key, err := opening(helperproto.FrameReattach, ra)
	if err != nil {
		x.mu.Unlock()
		return err
	}
	x.key = key
	x.mu.Unlock()
	return x.run(ctx, r, cio, x.remote, b, false, false)
}

// Unheld has the helper run the command with pipes of its own instead of
// the holder (durable exec turned off): a connection lost while it runs
// then ends the exec with "may or may not have completed". Call it before
// Run.
func (x *Exchange) Unheld() error {
	x.hold, x.reqv.Hold = "", ""
	var err error
	x.req, x.key, err = marshalRequest(x.reqv)
	return err
}

// Held says the command runs under the helper's holder (it outlives a
// lost connection), and the helper said it started.
func (x *Exchange) Held() bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.hold != "" && x.a.started != nil && x.a.hello && x.a.version == helperproto.Version
}

// Exited says the helper reported the command's status.
func (x *Exchange) Exited() bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.a.exit != nil
}

// GiveUp records why the command's end is unknown (a reattach that did
// not happen), which Finish reports, unless something came first.
func (x *Exchange) GiveUp(err error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.a.err == nil && x.a.exit == nil {
		x.a.err = err
	}
}

// stdinChunks is the caller's stdin read by one pump for every run of the
// exchange, so that a run that was lost leaves the next bytes to the
// reattach's; nil for no stdin. The pump ends with ctx.
func (x *Exchange) stdinChunks(ctx context.Context, stdin io.Reader) <-chan []byte {
	if stdin == nil {
		return nil
	}
	x.inOnce.Do(func() {
		x.in = make(chan []byte)
		go func() {
			defer close(x.in)
			for {
				buf := make([]byte, helperproto.DataChunk)
				n, err := stdin.Read(buf)
				if n > 0 {
					select {
					case x.in <- buf[:n]:
					case <-ctx.Done():
						return
					}
				}
				if err != nil {
					return
				}
			}
		}()
	})
	return x.in
}

// run runs one exec of the exchange: command, with the opening frames req
// and, when patch, an early request's Patch frame as soon as it is
// computed, before any stdin. With relay, an ExchangeRunner r runs it
// when it can take it.
func (x *Exchange) run(ctx context.Context, r Runner, cio ExchangeIO, command string, req []byte, patch, relay bool) error {
	ctx, cancel := context.WithCancel(ctx)
	// Not cancelled at once when run returns before the helper's process
	// ended (detach): a cancel sends it TERM.
	detach := false
	defer func() {
		if !detach {
			cancel()
		}
	}()
	if x.a.pull.buf == nil {
		x.a.pull = limitedBuffer{max: x.s.maxBytes + 128, buf: &bytes.Buffer{}}
		x.a.log = limitedBuffer{max: maxHelperLog, buf: &bytes.Buffer{}}
	}
	in := x.stdinChunks(context.WithoutCancel(ctx), cio.Stdin)

	inR, inW := io.Pipe()
	done := make(chan struct{})
	var once sync.Once
	// The request stream ends with the answer: then the exec's stdin
	// closes, whatever the caller's stdin does.
	stop := func() {
		once.Do(func() {
			close(done)
			_ = inW.CloseWithError(io.EOF)
		})
	}
	var inMu sync.Mutex
	fw := &helperproto.FrameWriter{W: inW}
	send := func(f func() error) bool {
		inMu.Lock()
		defer inMu.Unlock()
		return f() == nil
	}
	pr, preamble := r.(PreambleRunner)
	er, relayed := r.(ExchangeRunner)
	// The relay takes the opening frames in its request: a preamble.
	relayed = relayed && relay && preamble && x.setup != ""
	go func() {
		if !preamble && !send(func() error { _, err := inW.Write(req); return err }) {
			return
		}
		if patch {
			b := x.patchFrame(ctx)
			if b == nil || !send(func() error { return fw.Write(helperproto.FramePatch, b) }) {
				return
			}
		}
		if in != nil {
			go func() {
				for {
					select {
					case <-done:
						return
					case b, ok := <-in:
						if !ok {
							send(func() error { return fw.Write(helperproto.FrameStdinEOF, nil) })
							return
						}
						if !send(func() error { return fw.Data(helperproto.FrameStdin, x.inOff, b) }) {
							return
						}
						x.inOff += int64(len(b))
					}
				}
			}()
		} else {
			send(func() error { return fw.Write(helperproto.FrameStdinEOF, nil) })
		}
		for {
			select {
			case <-done:
				return
			case sig, ok := <-cio.Signals:
				if !ok {
					<-done
					return
				}
				if helperproto.ValidSignal(sig) {
					send(func() error { return fw.JSON(helperproto.FrameSignal, helperproto.Signal{Name: sig}) })
				}
			}
		}
	}()

	outR, outW := io.Pipe()
	read, answered := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(read)
		x.read(outR, cio, cancel)
		close(answered)
		stop()
		// A stream that broke the protocol is drained, unread, until the
		// exec ends (cancelled above).
		_, _ = io.Copy(io.Discard, outR)
	}()
	logw := &gatedWriter{w: &x.a.log}
	ran := make(chan runResult, 1)
	go func() {
		var res runResult
		taken := false
		if relayed {
			res.code, taken, res.err = er.RunExchange(ctx, RelayedExchange{Setup: x.setup, SetupDone: relaySetupDone, Opening: req, Hold: x.hold}, inR, outW, logw)
		}
		switch {
		case taken:
		case preamble:
			res.code, res.err = pr.RunPreamble(ctx, command, req, inR, outW, logw)
		default:
			res.code, res.err = r.Run(ctx, command, inR, outW, logw)
		}
		_ = outW.Close()
		ran <- res
	}()
	res, ok := runResult{}, false
	select {
	case res = <-ran:
		ok = true
	case <-answered:
	}
	// A relay's end follows the exchange's at once, and frees the relay
	// for the next exec: it is waited for.
	if !ok && !relayed && x.endedWell() {
		select {
		case res, ok = <-ran:
		default:
			// The helper said everything: the end of its process (about a
			// millisecond) is not waited for. Its channel closes by
			// itself, or is cut endGrace later.
			logw.close()
			detach = true
			go func() {
				t := time.AfterFunc(endGrace, cancel)
				<-ran
				t.Stop()
				cancel()
			}()
			res, ok = runResult{code: 0}, true
		}
	}
	if !ok {
		res = <-ran
	}
	if !detach {
		<-read
	}
	stop()
	x.mu.Lock()
	defer x.mu.Unlock()
	x.a.code = res.code
	if x.a.err != nil {
		return x.a.err
	}
	return res.err
}

// endGrace bounds how long the channel of an exchange that ended well
// may stay open once run returned.
const endGrace = 10 * time.Second

type runResult struct {
	code int
	err  error
}

// endedWell says the helper sent its End frame and broke no rule.
func (x *Exchange) endedWell() bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.a.end && x.a.err == nil && x.a.pullEnd != nil
}

// gatedWriter writes to w until closed, then drops what comes: the
// helper's stderr once run returned without waiting for its process.
type gatedWriter struct {
	mu     sync.Mutex
	w      io.Writer
	closed bool
}

func (g *gatedWriter) Write(p []byte) (int, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return len(p), nil
	}
	return g.w.Write(p)
}

func (g *gatedWriter) close() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
}

// patchFrame is the Patch frame of an early request: its patch and push
// script once computed, or that they were not (the helper then runs
// nothing). nil: ctx ended first.
func (x *Exchange) patchFrame(ctx context.Context) []byte {
	var pf helperproto.Patch
	if err := x.p.early.wait(ctx); ctx.Err() != nil {
		return nil
	} else if err != nil {
		// The daemon's own error stays here (it names local paths).
		pf.Error = "the daemon's git could not compute it"
	} else {
		pf.Patch, pf.PushScript = x.p.Data, x.pushIn.pushScript(x.p.Data)
	}
	b, err := json.Marshal(pf)
	if err != nil || len(b) > helperproto.MaxRequest {
		b, _ = json.Marshal(helperproto.Patch{Error: "the patch is over what a frame may carry"})
	}
	return b
}

// Started says the helper said the command was about to start: from then
// on the command may have run, and is never run again.
func (x *Exchange) Started() bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.a.started != nil
}

// read reads the helper's frames until End, the stream's end or a
// violation (then cancel ends the exec).
func (x *Exchange) read(r io.Reader, cio ExchangeIO, cancel func()) {
	x.mu.Lock()
	key := x.key
	x.mu.Unlock()
	fr := &helperproto.FrameReader{R: r, Budget: x.s.maxBytes + 4<<20, Key: key}
	var outErr, errErr error
	for {
		typ, payload, err := fr.Next()
		if errors.Is(err, io.EOF) {
			return
		}
		if errors.Is(err, helperproto.ErrTruncated) && x.Held() {
			// The connection broke mid-frame: the frame's bytes were not
			// counted, so a reattach asks for them again.
			x.s.log.Debug("the exchange's stream ended inside a frame", "err", err)
			return
		}
		if err == nil {
			err = x.take(typ, payload, cio, &outErr, &errErr)
		}
		if errors.Is(err, ErrReattach) {
			x.mu.Lock()
			x.a.err = errdefs.Unavailable(fmt.Errorf("the command may still be running in the sandbox; it was not run again: %w", err))
			x.mu.Unlock()
			cancel()
			return
		}
		if err != nil {
			x.mu.Lock()
			x.a.err = errdefs.Unavailable(newError(ErrForgedReport, err, "the sandbox helper's answer broke the protocol (%v)", err))
			x.mu.Unlock()
			cancel()
			return
		}
		x.mu.Lock()
		end := x.a.end
		x.mu.Unlock()
		if end {
			return
		}
	}
}

// take checks one answer frame against what came before and applies it.
func (x *Exchange) take(typ byte, payload []byte, cio ExchangeIO, outErr, errErr *error) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	a := &x.a
	if !a.hello && typ != helperproto.FrameHelloAnswer {
		return fmt.Errorf("frame %q before the helper's hello", typ)
	}
	if a.end {
		return fmt.Errorf("frame %q after the end", typ)
	}
	ended := a.declined != nil || a.pushFail != nil
	switch typ {
	case helperproto.FrameHelloAnswer:
		var h helperproto.HelloAnswer
		if a.hello {
			return errors.New("a second hello")
		}
		if err := helperproto.Decode(typ, payload, &h); err != nil {
			return err
		}
		a.hello, a.version = true, h.Version
		if h.Version != helperproto.Version && x.reattached {
			return fmt.Errorf("%w: the sandbox helper speaks version %d, not %d (was it replaced?)", ErrReattach, h.Version, helperproto.Version)
		}
		if h.Version != helperproto.Version {
			// The helper takes nothing: the shell way (Finish).
			a.end = true
		}
	case helperproto.FrameDeclined, helperproto.FramePushFailed:
		if x.reattached && typ == helperproto.FrameDeclined {
			var d helperproto.Declined
			_ = helperproto.Decode(typ, payload, &d)
			return fmt.Errorf("%w: the sandbox helper declined (%s)", ErrReattach, sandboxText(clip([]byte(d.Reason))))
		}
		if a.started != nil {
			return errors.New("a report that nothing ran, after the command started")
		}
		if ended {
			return errors.New("two final reports")
		}
		if typ == helperproto.FrameDeclined {
			a.declined = &helperproto.Declined{}
			return helperproto.Decode(typ, payload, a.declined)
		}
		a.pushFail = &helperproto.PushFailed{}
		if err := helperproto.Decode(typ, payload, a.pushFail); err != nil {
			return err
		}
		if a.pushFail.Code <= 0 || a.pushFail.Code > 255 {
			return fmt.Errorf("a push failure with exit code %d", a.pushFail.Code)
		}
	case helperproto.FrameStarted:
		if a.started != nil || ended {
			return errors.New("a start out of order")
		}
		if a.pull.buf.Len() > 0 {
			return errors.New("pull output before the start")
		}
		a.started = &helperproto.Started{}
		if err := helperproto.Decode(typ, payload, a.started); err != nil {
			return err
		}
		if !shaPattern.MatchString(a.started.Snapshot) {
			a.started.Snapshot = ""
		}
		if !shaPattern.MatchString(a.started.Tree) {
			a.started.Tree = ""
		}
	case helperproto.FrameStdout, helperproto.FrameStderr:
		if a.started == nil || a.exit != nil {
			return fmt.Errorf("command output outside the command's run")
		}
		off, data, err := helperproto.SplitData(payload)
		if err != nil {
			return err
		}
		n, w, werr := &a.out, cio.Stdout, outErr
		if typ == helperproto.FrameStderr {
			n, w, werr = &a.errn, cio.Stderr, errErr
		}
		if off != *n {
			return fmt.Errorf("output at offset %d, after %d bytes", off, *n)
		}
		*n += int64(len(data))
		if w != nil && *werr == nil && len(data) > 0 {
			// The caller's writer may block: not under the lock.
			x.mu.Unlock()
			_, *werr = w.Write(data)
			x.mu.Lock()
		}
	case helperproto.FrameExit:
		if a.started == nil || a.exit != nil {
			return errors.New("an exit status out of order")
		}
		e := &helperproto.Exit{}
		if err := helperproto.Decode(typ, payload, e); err != nil {
			return err
		}
		if e.Code < 0 || e.Code > 255 || (e.Signal != "" && !helperproto.ValidSignal(e.Signal)) {
			return fmt.Errorf("exit status %d, signal %q", e.Code, e.Signal)
		}
		a.exit = e
	case helperproto.FramePull:
		if (a.started != nil && a.exit == nil) || a.pullEnd != nil || ended {
			return errors.New("pull output out of order")
		}
		_, _ = a.pull.Write(payload)
	case helperproto.FramePullEnd:
		if a.exit == nil || a.pullEnd != nil {
			return errors.New("a pull's end out of order")
		}
		a.pullEnd = &helperproto.PullEnd{}
		return helperproto.Decode(typ, payload, a.pullEnd)
	case helperproto.FrameEnd:
		if !ended && a.pullEnd == nil {
			return errors.New("the end before the exchange's report")
		}
		a.end = true
	default:
		return fmt.Errorf("unknown frame %q", typ)
	}
	return nil
}

// Finish completes the exchange once Run returned: the push's bookkeeping,
// then the command's edits applied to the local working tree (or saved)
// and acknowledged. An error means the command did not run (the push
// failed) or its status is unknown (never run again); a failed pull is
// reported in Fused.PullErr. A damaged pull is fetched again.
func (x *Exchange) Finish(ctx context.Context, r Runner) (Fused, error) {
	x.mu.Lock()
	a := x.a
	x.mu.Unlock()
	res := Fused{Push: PushResult{Commits: x.commit}}
	if log := a.log.buf.Bytes(); len(log) > 0 {
		x.s.log.Debug("sandbox helper", "said", sandboxText(string(log)))
	}
	ea := x.p.early
	if ea != nil && (a.started == nil || x.s.verify) {
		// Nothing ran, and the helper's answer may be about the patch;
		// once the command ran the pull needs nothing of it (the next
		// Prepare waits for it), except the check of tests (verify).
		if err := ea.wait(ctx); ctx.Err() != nil {
			return res, err
		}
		if a.started == nil && a.pushFail != nil && ea.err != nil {
			// The helper needed the patch git did not compute: nothing
			// ran, and the next Prepare scans the whole tree.
			x.s.log.Debug("the sandbox helper needed the patch behind an early request, which failed; preparing again", "err", ea.err)
			res.Again = true
			return res, nil
		}
	}
	switch {
	case a.started == nil && a.err != nil:
		return res, a.err
	case a.started == nil && !a.hello && (a.code <= 0 || a.code > 127):
		// No answer, yet the exec did not fail as a missing helper or a
		// failed prelude does (it exited 0, or by a signal): the helper
		// may have run the command, and its answer was taken out of the
		// channel on the way (a process of the user can read the pipe).
		return res, errdefs.Unavailable(newError(ErrForgedReport, nil, "the exchange ended (status %d) without a word from the sandbox helper: the command may or may not have completed, so it was not run again; what it changed stays in the sandbox and the next exec brings it back", a.code))
	case a.started == nil && (!a.hello || a.version != helperproto.Version):
		// The helper is missing, failed before it answered, or speaks
		// another version: nothing of the exchange ran.
		res.Split = true
		return res, nil
	case a.declined != nil:
		res.Split = true
		return res, nil
	case a.pushFail != nil:
		if _, err := x.s.pushFailed(ctx, r, x.rp, x.p, a.pushFail.Code, &a.pull, sandboxText(a.pushFail.Stderr), 0, &res.Push); err != nil {
			return res, err
		}
		// Whether or not the local tree changed, the command has yet to run.
		res.Again = true
		return res, nil
	case a.started == nil:
		// The helper ended before it said the command starts: an honest
		// helper has not started it.
		res.Split = true
		return res, nil
	}
	res.Native = a.started.Native
	x.s.pushDone(x.p, x.pend, a.started.Snapshot, &res.Push)
	if a.exit == nil {
		if a.err != nil {
			return res, a.err
		}
		return res, errdefs.Unavailable(newError(ErrTransfer, nil, "the sandbox helper ended before it reported the command's status (the connection broke or the helper died): the command may or may not have completed, so it was not run again; what it changed stays in the sandbox and the next exec brings it back"))
	}
	if x.hold != "" {
		x.s.heldEnded(x.rp.root, x.hold)
	}
	res.Ran, res.ExitCode, res.Signal = true, a.exit.Code, a.exit.Signal
	if a.exit.Signal != "" {
		res.ExitCode = 128 + signalNumber(a.exit.Signal)
	}
	var id, saved string
	var patch []byte
	var err error
	switch {
	case a.pullEnd == nil || a.pull.overflow || a.err != nil:
		x.s.log.Warn("the pull part of a fused exec arrived damaged, pulling again")
		id, patch, saved, err = x.s.fetchPull(ctx, r, x.rp)
	case a.pullEnd.TooLarge:
		id, patch, saved, err = x.s.pullFailed(ctx, r, x.rp, exitTooLarge, &a.pull, "")
	case a.pullEnd.Code != 0:
		id, patch, saved, err = x.s.pullFailed(ctx, r, x.rp, a.pullEnd.Code, &a.pull, sandboxText(a.pullEnd.Stderr))
	default:
		id, patch, saved, err = x.s.pullOutput(ctx, r, x.rp, &a.pull, 0, nil)
	}
	res.Pull, res.PullErr = x.s.land(ctx, x.rp, x.start, id, patch, saved, err)
	if ea != nil && x.s.verify && (ea.err != nil || ea.mismatch != nil) {
		return res, fmt.Errorf("verify: the early request: %w", errors.Join(ea.err, ea.mismatch))
	}
	return res, nil
}

// signalNumber is the number of a signal named as SSH names it, 127 for a
// name it does not know (so 128+n stays in 0..255).
func signalNumber(name string) int {
	if i := slices.Index(signalNames, name); i > 0 {
		return i
	}
	return 127
}

var signalNames = []string{"", "HUP", "INT", "QUIT", "ILL", "TRAP", "ABRT", "BUS", "FPE", "KILL", "USR1", "SEGV", "USR2", "PIPE", "ALRM", "TERM"}

func clip(b []byte) string {
	if len(b) > 80 {
		b = b[:80]
	}
	return string(b)
}

// heldEnded notes that the held exchange id of root reported its exit: the
// next exchange's request asks the holder to forget it.
func (s *Syncer) heldEnded(root, id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ids := s.ended[root]; len(ids) < helperproto.MaxForget {
		s.ended[root] = append(ids, id)
	}
}

// takeEnded returns the ids heldEnded noted for root, and drops them: a
// request that does not arrive leaves them to the holder (no harm but
// their files).
func (s *Syncer) takeEnded(root string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	ids := s.ended[root]
	delete(s.ended, root)
	return ids
}

// holdID is an exec id for the helper's holder: 128 random bits.
func holdID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

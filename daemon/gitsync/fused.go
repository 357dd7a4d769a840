package gitsync

import (
	"bytes"
	"context"
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
// The request and the caller's stdin and signals travel as frames on the
// exec's stdin; the helper's answers as frames on its stdout, which the
// command never writes (it has pipes of its own, and the helper is not
// dumpable). Exchange reads and checks every answer frame:
//
//   - HelloAnswer first: no answer, or an unknown version, means the
//     helper did not take the exchange (Fused.Split: separate steps).
//   - Declined, or PushFailed after the push's output: nothing ran. Both
//     are believed only before Started; after it, the exchange ends with
//     ErrForgedReport and the command is not run again.
//   - Started, then the command's stdout and stderr (each frame's offset
//     must be the count received so far), Exit (a code 0..255 or a signal
//     name), the pull's output and PullEnd, End.
//
// The exec's own exit status carries nothing: a stream that ends after
// Started without Exit is a command whose status is unknown (error, not
// run again).
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
	req     []byte

	mu      sync.Mutex
	a       answers
	started bool
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
	log limitedBuffer
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
	// One look at the helper: the instance the exchange is for is the one
	// its request names.
	name, inst := syncHelper(r)
	if inst == "" {
		return nil, false, nil
	}
	rp, err := s.openRepo(ctx, p.RepoRoot)
	if err != nil {
		return nil, false, repoError(err)
	}
	x := &Exchange{s: s, rp: rp, p: p, pend: newID(), start: time.Now(), inst: inst}
	var res PushResult
	if err := s.pushCommitsIfNeeded(ctx, r, rp, p, &res); err != nil {
		return nil, false, err
	}
	x.commit = res.Commits
	hv := helperLine(name, inst)
	acks := s.acks(rp)
	now := s.now()
	req := helperproto.ExchangeRequest{
		Instance: inst, Head: p.HeadSHA, Time: now.Unix(), SnapRef: SnapshotRef, BaseRef: BaseRef,
		Pending: x.pend, Acks: acks, Max: s.maxBytes, DiffArgs: diffOptions, Command: command,
		PullScript: pullScript(hv, acks, s.maxBytes),
	}
	if entries, ok := nativeEntries(p.RepoRoot, p.recs, p.LFSFiles, MaxFusedPatch); ok {
		if b, ok := nativeBundle(entries); ok {
			req.Entries = []byte(b)
		}
	}
	req.Patch = p.Data
	req.PushScript = prelude + hv + `off=; [ ! -f "$st/native.off" ] || read -r off <"$st/native.off" || true
` + pushBody(p.HeadSHA, patchKey(p.Data), now, x.pend, acks, s.maxBytes, p.LargeTree, true)
	if x.req, err = marshalRequest(req); err != nil {
		return nil, false, err
	}
	// The exec's shell finds the repository, brings in edits made outside
	// an exec (strayEdits) and setup's files, then becomes the helper
	// (exec: no shell stays between the channel and the helper).
	x.command = prelude + hv + setupEdits + strayEdits(acks) + `exec "$H" exchange -state "$st" -path "$P0" -sready "$sready" -c0 "$c0"` + "\n"
	return x, true, nil
}

func marshalRequest(req helperproto.ExchangeRequest) ([]byte, error) {
	var b bytes.Buffer
	fw := &helperproto.FrameWriter{W: &b}
	if err := fw.JSON(helperproto.FrameHello, helperproto.Hello{Versions: []int{helperproto.Version}}); err != nil {
		return nil, err
	}
	if err := fw.JSON(helperproto.FrameRequest, req); err != nil {
		return nil, err
	}
	if b.Len() > helperproto.MaxRequest {
		return nil, errdefs.TooLarge(fmt.Errorf("the exchange's request is %s, over the %s a request may carry", formatBytes(int64(b.Len())), formatBytes(helperproto.MaxRequest)))
	}
	return b.Bytes(), nil
}

// Command is the remote command of the exchange.
func (x *Exchange) Command() string { return x.command }

// Run runs the exchange on r with the caller's streams. An error is the
// transport's (the connection broke, ctx ended) or the helper's answer
// breaking the protocol; Finish says what happened either way.
func (x *Exchange) Run(ctx context.Context, r Runner, cio ExchangeIO) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	x.a.pull = limitedBuffer{max: x.s.maxBytes + 128, buf: &bytes.Buffer{}}
	x.a.log = limitedBuffer{max: maxHelperLog, buf: &bytes.Buffer{}}

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
	go func() {
		if !preamble && !send(func() error { _, err := inW.Write(x.req); return err }) {
			return
		}
		if cio.Stdin != nil {
			go func() {
				buf := make([]byte, helperproto.DataChunk)
				var off int64
				for {
					n, err := cio.Stdin.Read(buf)
					if n > 0 && !send(func() error { return fw.Data(helperproto.FrameStdin, off, buf[:n]) }) {
						return
					}
					off += int64(n)
					if err != nil {
						send(func() error { return fw.Write(helperproto.FrameStdinEOF, nil) })
						return
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
	read := make(chan struct{})
	go func() {
		defer close(read)
		x.read(outR, cio, cancel)
		stop()
		// A stream that broke the protocol is drained, unread, until the
		// exec ends (cancelled above).
		_, _ = io.Copy(io.Discard, outR)
	}()
	var err error
	if preamble {
		_, err = pr.RunPreamble(ctx, x.command, x.req, inR, outW, &x.a.log)
	} else {
		_, err = r.Run(ctx, x.command, inR, outW, &x.a.log)
	}
	_ = outW.Close()
	<-read
	stop()
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.a.err != nil {
		return x.a.err
	}
	return err
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
	fr := &helperproto.FrameReader{R: r, Budget: x.s.maxBytes + 4<<20}
	var outErr, errErr error
	for {
		typ, payload, err := fr.Next()
		if errors.Is(err, io.EOF) {
			return
		}
		if err == nil {
			err = x.take(typ, payload, cio, &outErr, &errErr)
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
		if h.Version != helperproto.Version {
			// The helper takes nothing: the shell way (Finish).
			a.end = true
		}
	case helperproto.FrameDeclined, helperproto.FramePushFailed:
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
	switch {
	case a.started == nil && a.err != nil:
		return res, a.err
	case a.started == nil && (!a.hello || a.version != helperproto.Version):
		// The helper is missing or speaks another version: nothing of
		// the exchange ran.
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
	case a.pullEnd.Code != 0:
		id, patch, saved, err = x.s.pullFailed(ctx, r, x.rp, a.pullEnd.Code, &a.pull, sandboxText(a.pullEnd.Stderr))
	default:
		id, patch, saved, err = x.s.pullOutput(ctx, r, x.rp, &a.pull, 0, nil)
	}
	res.Pull, res.PullErr = x.s.land(ctx, x.rp, x.start, id, patch, saved, err)
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

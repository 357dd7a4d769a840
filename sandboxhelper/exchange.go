package sandboxhelper

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/sandboxd/sandboxd/internal/helperproto"
	"github.com/sandboxd/sandboxd/sandboxhelper/hold"
)

// stageTimeout bounds a stage through the server (git add of what
// changed, or of everything).
const stageTimeout = 10 * time.Minute

// maxScriptOutput bounds what the helper keeps of a push or pull script's
// stderr, and of the push script's stdout beyond the patch bound.
const maxScriptOutput = 64 << 10

// Exchange is the verb `exchange` (the protocol in package helperproto):
// it reads the daemon's frames on in and writes its own on out, which no
// other process writes. It looks for edits made outside an exec (stray),
// pushes (natively through the server, or by the request's push script
// after a stage through the server), says Started, runs the user's
// command with pipes of its own in a session of its own, frames its
// output, reports its exit, then pulls (natively, or by the pull script
// after a stage through the server) and sends the patch.
//
// Before anything, it makes itself non-dumpable: a command of the same uid
// then cannot open /proc/<helper>/fd/1 (the channel), read its memory or
// ptrace it. The command's own process is dumpable again (execve resets
// it), so nothing changes for it. A process that opened the channel
// before (the exec's shell and the helper until the prctl are dumpable)
// keeps it: the tags of the answers (helperproto.AnswerKey) are what make
// its frames fail.
func Exchange(ctx context.Context, o ExchangeOptions, in io.Reader, out io.Writer, log io.Writer) int {
	var sigs chan os.Signal // in the relay: none of its own
	if !o.InRelay {
		undumpable()
		// Signals the agent relays to this exec go to the command; a
		// write to a channel that went away fails instead of killing the
		// helper, so the pull still leaves the edits in the sandbox.
		sigs = make(chan os.Signal, 4)
		signal.Notify(sigs, syscall.SIGHUP, syscall.SIGINT, syscall.SIGQUIT, syscall.SIGTERM, syscall.SIGPIPE)
		defer signal.Stop(sigs)
	}
	if o.Env == nil {
		o.Env = os.Environ()
	}
	ctx = context.WithoutCancel(ctx)

	// Nothing is read or written before the prctl above. The hello's
	// nonce and the request key every answer frame (helperproto.AnswerKey),
	// the hello answer too, so it comes after the request: no answer can
	// be tagged without them.
	fr := &helperproto.FrameReader{R: in}
	x := &exchange{state: o.State, root: o.Root, env: o.Env, fw: &helperproto.FrameWriter{W: out}, fr: fr, log: log}
	typ, p, err := fr.Next()
	var hello helperproto.Hello
	if err == nil && typ == helperproto.FrameHello {
		err = helperproto.Decode(typ, p, &hello)
	} else if err == nil {
		err = fmt.Errorf("expected a hello frame, got %q", typ)
	}
	if err == nil && len(hello.Nonce) != helperproto.NonceSize {
		err = fmt.Errorf("a hello with a nonce of %d bytes", len(hello.Nonce))
	}
	var rtyp byte
	var rp []byte
	if err == nil {
		rtyp, rp, err = fr.Next()
	}
	if err != nil {
		// Without the nonce and the request no answer can be tagged: the
		// daemon sees none (the separate steps; nothing ran here).
		fmt.Fprintf(log, "%s exchange: read the hello and the request: %v\n", Name, err)
		return exitUsage
	}
	x.fw.Key = helperproto.AnswerKey(hello.Nonce, rp)
	if !slices.Contains(hello.Versions, helperproto.Version) {
		_ = x.send(helperproto.FrameHelloAnswer, helperproto.HelloAnswer{})
		fmt.Fprintf(log, "%s exchange: no common version (%v)\n", Name, hello.Versions)
		return exitUsage
	}
	if err := x.send(helperproto.FrameHelloAnswer, helperproto.HelloAnswer{Version: helperproto.Version}); err != nil {
		return exitFailed
	}
	if rtyp == helperproto.FrameReattach {
		return x.reattach(ctx, rp, fr, sigs)
	}
	if rtyp != helperproto.FrameRequest {
		err = fmt.Errorf("expected a request frame, got %q", rtyp)
	}
	var req helperproto.ExchangeRequest
	if err == nil {
		err = helperproto.Decode(rtyp, rp, &req)
	}
	if err != nil {
		x.decline("read the request: " + err.Error())
		return exitUsage
	}
	// The command's PATH is the sandbox's own (the exec's shell added
	// git's usual places to its PATH).
	req.Path = o.Path
	if len(req.Forget) > 0 && len(req.Forget) <= helperproto.MaxForget {
		// Off the exchange's path: earlier exchanges the daemon saw end.
		go forget(req.Forget)
	}
	if !x.stray(ctx, &req) {
		return 0
	}
	started, ok := x.push(ctx, &req)
	if !ok {
		return 0
	}
	started.Tree = x.tree
	if err := x.send(helperproto.FrameStarted, started); err != nil {
		// Nobody listens: the command does not start.
		return exitFailed
	}
	var exit helperproto.Exit
	if req.Hold != "" {
		env := x.env
		if req.Path != "" {
			env = withPath(env, req.Path)
		}
		if exit, ok = x.held(ctx, req.Hold, []string{"/bin/sh", "-c", req.Command}, env, 0, 0, fr, sigs); !ok {
			// The channel is gone: the command goes on under the holder,
			// and the reattach that follows it pulls.
			return exitFailed
		}
	} else {
		exit = x.run(&req, fr, sigs)
	}
	if err := x.send(helperproto.FrameExit, exit); err != nil {
		fmt.Fprintf(log, "%s exchange: %v\n", Name, err)
		if req.Hold != "" {
			return exitFailed
		}
	}
	x.pull(ctx, &req, started)
	_ = x.fw.Write(helperproto.FrameEnd, nil)
	return 0
}

// forget removes what the holder kept of the ended execs ids.
func forget(ids []string) {
	root, err := hold.DefaultRoot()
	if err != nil {
		return
	}
	h := &hold.Holder{Root: root}
	for _, id := range ids {
		_ = h.Forget(id)
	}
}

// reattach answers a Reattach: the rest of the held command's output from
// the daemon's offsets, its exit and the pull, as the lost exchange would
// have sent them. An id the holder never started is declined: nothing
// starts here.
func (x *exchange) reattach(ctx context.Context, p []byte, fr *helperproto.FrameReader, sigs <-chan os.Signal) int {
	var ra helperproto.Reattach
	if err := helperproto.Decode(helperproto.FrameReattach, p, &ra); err != nil {
		x.decline("read the reattach: " + err.Error())
		return exitUsage
	}
	if ra.Out < 0 || ra.Err < 0 {
		x.decline("negative offsets")
		return exitUsage
	}
	root, err := hold.DefaultRoot()
	if err != nil {
		x.decline("find the holder's directory: " + err.Error())
		return exitFailed
	}
	st, err := (&hold.Holder{Root: root}).State(ra.Hold)
	if err != nil || !st.Started {
		x.decline(fmt.Sprintf("no command of exec id %q was started here (%v)", ra.Hold, err))
		return 0
	}
	x.tree = ra.Tree
	exit, ok := x.held(ctx, ra.Hold, nil, nil, ra.Out, ra.Err, fr, sigs)
	if !ok {
		return exitFailed
	}
	if err := x.send(helperproto.FrameExit, exit); err != nil {
		return exitFailed
	}
	x.pull(ctx, &ra.Request, helperproto.Started{Native: x.tree != ""})
	_ = x.fw.Write(helperproto.FrameEnd, nil)
	return 0
}

// held starts argv under the holder as exec id (once: argv nil only
// follows it), relays the daemon's stdin and signals to it and frames its
// output from the offsets out and errOff until it ended. ok false: the
// daemon's stream ended or a frame could not be written first (the channel
// is gone), or the holder lost the command; the command goes on for a
// reattach and nothing is pulled here.
func (x *exchange) held(ctx context.Context, id string, argv, env []string, out, errOff int64, fr *helperproto.FrameReader, sigs <-chan os.Signal) (helperproto.Exit, bool) {
	root, err := hold.DefaultRoot()
	if err != nil {
		fmt.Fprintf(x.log, "%s exchange: find the holder's directory: %v\n", Name, err)
		return helperproto.Exit{}, false
	}
	h := &hold.Holder{Root: root}
	if argv != nil {
		self, err := os.Executable()
		if err == nil {
			h.Keeper = []string{self, "hold", "keep"}
			wd, werr := os.Getwd()
			err = werr
			if err == nil {
				o := hold.Options{Self: self, Server: func(ctx context.Context, id string, req hold.SpawnRequest) error {
					return askHold(ctx, self, id, req)
				}}
				err = o.Begin(ctx, h, id, argv, env, wd)
			}
		}
		if errors.Is(err, hold.ErrRecordGone) {
			// It may have run: no status of ours stands for it. The
			// daemon's end of an exchange without its Exit says so.
			fmt.Fprintf(x.log, "%s exchange: %v\n", Name, err)
			return helperproto.Exit{}, false
		}
		if err != nil && !errors.Is(err, hold.ErrStarted) {
			_ = x.data(helperproto.FrameStderr, 0, []byte(fmt.Sprintf("%s: hold the command: %v\n", Name, err)))
			return helperproto.Exit{Code: 127}, true
		}
	}
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	pr, pw := io.Pipe()
	go func() {
		// The end of the caller's stdin (the pipe closed without an
		// error) ends the command's; a lost channel does not.
		if err := h.Feed(actx, id, pr); err == nil {
			_ = h.EOF(id)
		}
	}()
	go func() {
		for {
			typ, p, err := fr.Next()
			if err != nil {
				// The channel is gone (the daemon closes it only after
				// the End): the attach ends, the command goes on.
				pw.CloseWithError(fmt.Errorf("the daemon's stream ended: %w", err))
				cancel()
				return
			}
			switch typ {
			case helperproto.FrameStdin:
				if _, d, err := helperproto.SplitData(p); err == nil {
					_, _ = pw.Write(d)
				}
			case helperproto.FrameStdinEOF:
				_ = pw.Close()
			case helperproto.FrameSignal:
				var s helperproto.Signal
				if helperproto.Decode(typ, p, &s) == nil {
					if n := signalNumber(s.Name); n > 0 {
						_ = h.Signal(id, syscall.Signal(n))
					}
				}
			}
		}
	}()
	go func() {
		for {
			select {
			case s := <-sigs:
				// A hang-up is the channel's end, not the command's.
				if s != syscall.SIGPIPE && s != syscall.SIGHUP {
					_ = h.Signal(id, s.(syscall.Signal))
				}
			case <-actx.Done():
				return
			}
		}
	}()
	code, err := h.Attach(actx, id, out, errOff, &frameOut{x: x, typ: helperproto.FrameStdout, off: out}, &frameOut{x: x, typ: helperproto.FrameStderr, off: errOff})
	if err != nil {
		fmt.Fprintf(x.log, "%s exchange: follow the held command: %v\n", Name, err)
		return helperproto.Exit{}, false
	}
	if st, err := h.State(id); err == nil && st.Signal != "" {
		if n := signalNumber(st.Signal); n > 0 && code == 128+n {
			return helperproto.Exit{Signal: st.Signal}, true
		}
	}
	return helperproto.Exit{Code: code}, true
}

// frameOut frames what it is given as the command's output from off.
type frameOut struct {
	x   *exchange
	typ byte
	off int64
}

func (w *frameOut) Write(p []byte) (int, error) {
	if err := w.x.data(w.typ, w.off, p); err != nil {
		return 0, err
	}
	w.off += int64(len(p))
	return len(p), nil
}

// ExchangeOptions are what the exchange's own shell found before it
// became the helper.
type ExchangeOptions struct {
	// State is the sync state directory (.git/sandboxd), Root the
	// checkout; Path the sandbox's own PATH, the command's.
	State, Root, Path string
	// Env is the environment of the scripts and the command (the
	// process's when nil).
	Env []string
	// InRelay: the exchange runs in the relay's process (relayExchange),
	// which is not dumpable already and whose signals are not the
	// command's: signals come as frames only.
	InRelay bool
}

type exchange struct {
	state, root string
	env         []string
	// pushEnv is what the stray look found, for the push script: sready
	// (the tree whose stray patch it made).
	pushEnv []string
	log     io.Writer
	mu      sync.Mutex
	fw      *helperproto.FrameWriter
	// fr reads the daemon's frames; push reads the Patch frame from it
	// before the command's relay reads the rest.
	fr *helperproto.FrameReader
	// tree is the tree the push left, when the server knows the working
	// tree (the native pull's base).
	tree string
}

func (x *exchange) send(typ byte, v any) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.fw.JSON(typ, v)
}

func (x *exchange) data(typ byte, off int64, p []byte) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.fw.Data(typ, off, p)
}

func (x *exchange) decline(reason string) {
	fmt.Fprintf(x.log, "%s exchange: declined: %s\n", Name, reason)
	_ = x.send(helperproto.FrameDeclined, helperproto.Declined{Reason: reason})
	_ = x.fw.Write(helperproto.FrameEnd, nil)
}

// push makes the checkout the request's tree: natively when the request
// has entries, no earlier exec's edits wait to be brought back and no
// decline for good holds for head; otherwise (or when the server
// declines) by the push script, with the patch of the request or, when it
// says PatchFollows, of the Patch frame read then (readPatch). ok false:
// the answer (Declined or PushFailed) was sent and nothing runs.
func (x *exchange) push(ctx context.Context, req *helperproto.ExchangeRequest) (helperproto.Started, bool) {
	offFile := filepath.Join(x.state, "native.off")
	offKey := req.Instance + " " + req.Head
	if len(req.Entries) > 0 && req.Instance != "" && !x.pendingUnacked(req.Acks) && firstLine(offFile) != offKey {
		a, err := ask(ctx, x.state, req.Instance, "push", forwardedPush{Head: req.Head, Entries: req.Entries, Time: req.Time, SnapRef: req.SnapRef, BaseRef: req.BaseRef})
		switch {
		case err != nil:
			fmt.Fprintf(x.log, "%s exchange: native push: %v\n", Name, err)
		case a.Declined != "":
			fmt.Fprintf(x.log, "%s exchange: native push declined: %s\n", Name, a.Declined)
			if a.ForGood {
				_ = os.WriteFile(offFile, []byte(offKey+"\n"), 0o644)
			}
		default:
			if req.Pending != "" {
				if err := os.WriteFile(filepath.Join(x.state, "pending"), []byte(req.Pending+"\n"), 0o644); err != nil {
					x.pushFailed(helperproto.PushFailed{Code: exitFailed, Stderr: "mark the exec pending: " + err.Error()})
					return helperproto.Started{}, false
				}
			}
			x.tree = a.Tree
			return helperproto.Started{Snapshot: a.Snap, Native: true}, true
		}
	}
	if req.PatchFollows {
		// Before the stage: without the patch nothing here changes.
		if msg := x.readPatch(req); msg != "" {
			fmt.Fprintf(x.log, "%s exchange: %s\n", Name, msg)
			x.pushFailed(helperproto.PushFailed{Code: exitFailed, Stderr: msg})
			return helperproto.Started{}, false
		}
	}
	var stdout, stderr bytes.Buffer
	cmd := exec.Command("/bin/sh", "-c", req.PushScript)
	cmd.Env = append(slices.Clone(x.env), "sready=", "hcur="+x.stagePush(ctx, req))
	cmd.Env = append(cmd.Env, x.pushEnv...)
	cmd.Stdin = bytes.NewReader(req.Patch)
	cmd.Stdout = &capped{buf: &stdout, max: req.Max + maxScriptOutput}
	cmd.Stderr = &capped{buf: &stderr, max: maxScriptOutput}
	if code := status(cmd.Run()); code.Code != 0 || code.Signal != "" {
		c := code.Code
		if code.Signal != "" {
			c = 128 + signalNumber(code.Signal)
		}
		if _, err := (&pullWriter{x: x}).Write(stdout.Bytes()); err == nil {
			x.pushFailed(helperproto.PushFailed{Code: c, Stderr: stderr.String()})
		}
		return helperproto.Started{}, false
	}
	// The push script prints the snapshot and the tree it made, which the
	// server adopts (unless a decline for good holds for head), so that
	// the pull and the next push are native.
	lines := strings.SplitN(stdout.String(), "\n", 3)
	for len(lines) < 2 {
		lines = append(lines, "")
	}
	st := helperproto.Started{Snapshot: strings.TrimSpace(lines[0])}
	if tree := strings.TrimSpace(lines[1]); isHex(tree) && req.Instance != "" && firstLine(offFile) != offKey {
		if a, err := ask(ctx, x.state, req.Instance, "adopt "+tree, nil); err != nil || a.Declined != "" {
			fmt.Fprintf(x.log, "%s exchange: adopt: %v%s\n", Name, err, a.Declined)
		} else {
			x.tree, st.Native = tree, true
		}
	}
	return st, true
}

// patchTimeout bounds the wait for the daemon's Patch frame, which it
// sends as soon as its git computed the patch.
const patchTimeout = 2 * time.Minute

// readPatch reads the Patch frame that follows a request with
// PatchFollows into req. It returns why the plain push cannot run ("" when
// it can): the frame did not come, is not a Patch frame, or says the
// daemon could not compute the patch. A command never runs on a tree made
// without it.
func (x *exchange) readPatch(req *helperproto.ExchangeRequest) string {
	type frame struct {
		typ byte
		p   []byte
		err error
	}
	got := make(chan frame, 1)
	go func() {
		// Left blocked only when the wait below gives up: the exchange
		// then ends, and the process with it.
		typ, p, err := x.fr.Next()
		got <- frame{typ, p, err}
	}()
	t := time.NewTimer(patchTimeout)
	defer t.Stop()
	var f frame
	select {
	case f = <-got:
	case <-t.C:
		return fmt.Sprintf("the daemon's sync patch did not come within %s; nothing ran: run the command again", patchTimeout)
	}
	if f.err == nil && f.typ != helperproto.FramePatch {
		f.err = fmt.Errorf("a frame %q where the patch was due", f.typ)
	}
	var pf helperproto.Patch
	if f.err == nil {
		f.err = helperproto.Decode(f.typ, f.p, &pf)
	}
	switch {
	case f.err != nil:
		return fmt.Sprintf("read the daemon's sync patch: %v; nothing ran: run the command again", f.err)
	case pf.Error != "":
		return fmt.Sprintf("the daemon could not compute the sync patch (%s); nothing ran: run the command again", pf.Error)
	case pf.PushScript == "":
		return "the daemon's sync patch came without its push script; nothing ran: run the command again"
	}
	req.Patch, req.PushScript, req.PatchFollows = pf.Patch, pf.PushScript, false
	return ""
}

// stray looks for edits made in the checkout outside an exec before the
// push (see daemon/gitsync, strayEdits): natively, a pull against the
// tree the last native pull left, when no earlier exec's edits wait; the
// stray script does the rest, or all of it when the native pull declines.
// ok false: the script could not run and the answer was sent.
func (x *exchange) stray(ctx context.Context, req *helperproto.ExchangeRequest) bool {
	if req.StrayScript == "" {
		return true
	}
	var env []string
	if t0 := firstLine(filepath.Join(x.state, "pulled.tree")); isHex(t0) && req.Instance != "" && !x.pendingUnacked(req.Acks) {
		out := filepath.Join(x.state, "stray.patch")
		a, err := ask(ctx, x.state, req.Instance, "pull", pullRequest{Tree: t0, Out: out, DiffArgs: req.DiffArgs})
		switch fi, serr := os.Stat(out); {
		case err != nil || a.Declined != "" || serr != nil:
			fmt.Fprintf(x.log, "%s exchange: native look for stray edits: %v%s\n", Name, err, a.Declined)
		case fi.Size() == 0:
			// The checkout holds the tree the last pull left.
			return true
		default:
			// The native pull wrote the checkout's tree to pulled.tree.
			if c1 := firstLine(filepath.Join(x.state, "pulled.tree")); isHex(c1) {
				env = []string{"x=" + t0, "c1=" + c1, "sready=" + t0}
			}
		}
	}
	if env == nil {
		env = []string{"x=", "c1=", "sready="}
	}
	var stdout, stderr bytes.Buffer
	cmd := exec.Command("/bin/sh", "-c", req.StrayScript)
	cmd.Env = append(slices.Clone(x.env), env...)
	cmd.Stdout = &capped{buf: &stdout, max: maxScriptOutput}
	cmd.Stderr = &capped{buf: &stderr, max: maxScriptOutput}
	if code := status(cmd.Run()); code.Code != 0 || code.Signal != "" {
		c := code.Code
		if code.Signal != "" {
			c = 128 + signalNumber(code.Signal)
		}
		x.pushFailed(helperproto.PushFailed{Code: c, Stderr: stderr.String()})
		return false
	}
	// Its last line: the tree whose stray patch it made, "-" for none.
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	if v := lines[len(lines)-1]; isHex(v) {
		x.pushEnv = []string{"sready=" + v}
	}
	return true
}

// stagePush stages the sync index through the server before the push
// script, which then moves the checkout from the tree it returns, and
// resets the user's index to head; "" when it did not (the script stages
// with git). Not when an earlier exec's edits wait: the script brings
// them back first and pushes nothing.
func (x *exchange) stagePush(ctx context.Context, req *helperproto.ExchangeRequest) string {
	if req.Instance == "" || x.pendingUnacked(req.Acks) || !x.syncIndex() {
		return ""
	}
	gd := filepath.Dir(x.state)
	ctx, cancel := context.WithTimeout(ctx, stageTimeout)
	defer cancel()
	res, err := Stage(ctx, StageOptions{Root: x.root, State: x.state, Instance: req.Instance, Index: filepath.Join(x.state, "index"),
		PrintTree: true, Head: req.Head, Real: filepath.Join(gd, "index")})
	if err != nil || !isHex(res.Tree) {
		fmt.Fprintf(x.log, "%s exchange: stage: %v\n", Name, err)
		return ""
	}
	return res.Tree
}

// syncIndex makes sure the sync index exists, as the scripts' syncidx
// does: a copy of the user's index, so that unchanged files are not
// hashed again.
func (x *exchange) syncIndex() bool {
	idx := filepath.Join(x.state, "index")
	if _, err := os.Stat(idx); err == nil {
		return true
	}
	_ = os.Remove(idx + ".fast")
	_ = os.Remove(idx + ".tree")
	b, err := os.ReadFile(filepath.Join(filepath.Dir(x.state), "index"))
	if errors.Is(err, os.ErrNotExist) {
		return true
	}
	return err == nil && os.WriteFile(idx, b, 0o644) == nil
}

// isHex says s is an object id as git prints it.
func isHex(s string) bool {
	if len(s) != 40 && len(s) != 64 {
		return false
	}
	for _, c := range s {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

func (x *exchange) pushFailed(f helperproto.PushFailed) {
	_ = x.send(helperproto.FramePushFailed, f)
	_ = x.fw.Write(helperproto.FrameEnd, nil)
}

// pendingUnacked says an earlier exec's edits wait to be brought back.
func (x *exchange) pendingUnacked(acks []string) bool {
	p := firstLine(filepath.Join(x.state, "pending"))
	return p != "" && !slices.Contains(acks, p)
}

// run runs the user's command and relays its streams and signals until it
// ends and its output is drained.
func (x *exchange) run(req *helperproto.ExchangeRequest, fr *helperproto.FrameReader, sigs <-chan os.Signal) helperproto.Exit {
	cmd := exec.Command("/bin/sh", "-c", req.Command)
	if req.Path != "" {
		cmd.Env = withPath(x.env, req.Path)
	}
	// A session of its own: the channel's process group is not the
	// command's, and the helper decides which signals reach it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	stdin, err1 := cmd.StdinPipe()
	stdout, err2 := cmd.StdoutPipe()
	stderr, err3 := cmd.StderrPipe()
	if err := errors.Join(err1, err2, err3); err != nil {
		_ = x.data(helperproto.FrameStderr, 0, []byte(fmt.Sprintf("%s: %v\n", Name, err)))
		return helperproto.Exit{Code: 127}
	}
	if err := cmd.Start(); err != nil {
		_ = x.data(helperproto.FrameStderr, 0, []byte(fmt.Sprintf("sh: %v\n", err)))
		return helperproto.Exit{Code: 127}
	}
	pgid := cmd.Process.Pid
	kill := func(sig syscall.Signal) { _ = syscall.Kill(-pgid, sig) }
	done := make(chan struct{})
	go func() {
		// The daemon's frames: stdin, its end, signals (a Patch frame
		// the native push did not need is skipped). The channel's end
		// without StdinEOF (the connection went away) ends stdin too.
		defer stdin.Close()
		for {
			typ, p, err := fr.Next()
			if err != nil {
				return
			}
			switch typ {
			case helperproto.FrameStdin:
				if _, d, err := helperproto.SplitData(p); err == nil {
					_, _ = stdin.Write(d)
				}
			case helperproto.FrameStdinEOF:
				_ = stdin.Close()
			case helperproto.FrameSignal:
				var s helperproto.Signal
				if helperproto.Decode(typ, p, &s) == nil {
					if n := signalNumber(s.Name); n > 0 {
						kill(syscall.Signal(n))
					}
				}
			}
		}
	}()
	go func() {
		for {
			select {
			case s := <-sigs:
				if s != syscall.SIGPIPE {
					kill(s.(syscall.Signal))
				}
			case <-done:
				return
			}
		}
	}()
	var wg sync.WaitGroup
	pump := func(typ byte, r io.Reader) {
		defer wg.Done()
		buf := make([]byte, helperproto.DataChunk)
		var off int64
		for {
			n, err := r.Read(buf)
			if n > 0 {
				_ = x.data(typ, off, buf[:n])
				off += int64(n)
			}
			if err != nil {
				return
			}
		}
	}
	wg.Add(2)
	go pump(helperproto.FrameStdout, stdout)
	go pump(helperproto.FrameStderr, stderr)
	// Wait for the pipes before Wait: Wait closes them.
	wg.Wait()
	ex := status(cmd.Wait())
	close(done)
	return ex
}

// pull sends the command's edits: the native pull when the server knows
// the tree the push left, else (or when it fails) the pull script's.
func (x *exchange) pull(ctx context.Context, req *helperproto.ExchangeRequest, st helperproto.Started) {
	// One pull at a time: the exchange of a lost channel may still pull
	// while the reattach's does; both write the same files.
	if lock, err := os.OpenFile(filepath.Join(x.state, "pull.lock"), os.O_CREATE|os.O_RDWR, 0o600); err == nil {
		defer lock.Close()
		_ = syscall.Flock(int(lock.Fd()), syscall.LOCK_EX)
	}
	if x.tree != "" && req.Instance != "" {
		out := filepath.Join(x.state, "pull.patch")
		a, err := ask(ctx, x.state, req.Instance, "pull", pullRequest{Tree: x.tree, Out: out, DiffArgs: req.DiffArgs})
		if err == nil && a.Declined == "" {
			if err := x.sendPatch(req, out); err == nil {
				return
			} else {
				fmt.Fprintf(x.log, "%s exchange: %v\n", Name, err)
			}
		} else if err != nil {
			fmt.Fprintf(x.log, "%s exchange: native pull: %v\n", Name, err)
		}
	}
	// The server stages what changed; without it the script stages
	// everything.
	staged := ""
	if req.Instance != "" && x.syncIndex() {
		ctx, cancel := context.WithTimeout(ctx, stageTimeout)
		defer cancel()
		if _, err := Stage(ctx, StageOptions{Root: x.root, State: x.state, Instance: req.Instance, Index: filepath.Join(x.state, "index")}); err == nil {
			staged = "1"
		} else {
			fmt.Fprintf(x.log, "%s exchange: stage: %v\n", Name, err)
		}
	}
	// The script writes the patch to the file the native pull writes.
	var stderr bytes.Buffer
	cmd := exec.Command("/bin/sh", "-c", req.PullScript)
	cmd.Env = append(slices.Clone(x.env), "hstaged="+staged)
	cmd.Stdout, cmd.Stderr = &capped{buf: &bytes.Buffer{}, max: 0}, &capped{buf: &stderr, max: maxScriptOutput}
	code := status(cmd.Run())
	c := code.Code
	if code.Signal != "" {
		c = 128 + signalNumber(code.Signal)
	}
	if c == 0 {
		if err := x.sendPatch(req, filepath.Join(x.state, "pull.patch")); err != nil {
			fmt.Fprintf(x.log, "%s exchange: %v\n", Name, err)
			_ = x.send(helperproto.FramePullEnd, helperproto.PullEnd{Code: exitFailed, Stderr: err.Error()})
		}
		return
	}
	_ = x.send(helperproto.FramePullEnd, helperproto.PullEnd{Code: c, Stderr: stderr.String()})
}

// sendPatch sends the native pull's patch in the pull script's format
// (header, patch), naming it in pull.id first so that a transfer that
// breaks can fetch it again.
func (x *exchange) sendPatch(req *helperproto.ExchangeRequest, path string) error {
	id := req.Pending
	if id == "" {
		id = "none"
		if p := firstLine(filepath.Join(x.state, "pending")); p != "" {
			id = p
		}
	}
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("open the pull's patch: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("open the pull's patch: %w", err)
	}
	if err := os.WriteFile(filepath.Join(x.state, "pull.id"), []byte(id+"\n"), 0o644); err != nil {
		return fmt.Errorf("name the pull's patch: %w", err)
	}
	pw := &pullWriter{x: x}
	size := fi.Size()
	if _, err := fmt.Fprintf(pw, "%s%s %d\n", PullHeader, id, size); err != nil {
		return err
	}
	if size > req.Max {
		return x.send(helperproto.FramePullEnd, helperproto.PullEnd{TooLarge: true})
	}
	if n, err := io.Copy(pw, io.LimitReader(f, size)); err != nil || n != size {
		return fmt.Errorf("send the pull's patch (%d of %d bytes): %v", n, size, err)
	}
	return x.send(helperproto.FramePullEnd, helperproto.PullEnd{})
}

// pullWriter frames what it is given as pull output.
type pullWriter struct {
	x   *exchange
	off int64
}

func (w *pullWriter) Write(p []byte) (int, error) {
	total := len(p)
	for len(p) > 0 {
		n := min(len(p), helperproto.MaxFrame/2)
		w.x.mu.Lock()
		err := w.x.fw.Write(helperproto.FramePull, p[:n])
		w.x.mu.Unlock()
		if err != nil {
			return 0, err
		}
		p, w.off = p[n:], w.off+int64(n)
	}
	return total, nil
}

// capped keeps the first max bytes written to it.
type capped struct {
	buf *bytes.Buffer
	max int64
}

func (c *capped) Write(p []byte) (int, error) {
	if room := c.max - int64(c.buf.Len()); room > 0 {
		c.buf.Write(p[:min(int64(len(p)), room)])
	}
	return len(p), nil
}

// status is how a command ended, from its Wait error.
func status(err error) helperproto.Exit {
	var ee *exec.ExitError
	switch {
	case err == nil:
		return helperproto.Exit{}
	case errors.As(err, &ee):
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			if name := signalNames[ws.Signal()]; name != "" {
				return helperproto.Exit{Signal: name}
			}
			return helperproto.Exit{Code: 128 + int(ws.Signal())}
		}
		return helperproto.Exit{Code: ee.ExitCode()}
	}
	return helperproto.Exit{Code: 127}
}

var signalNames = map[syscall.Signal]string{
	syscall.SIGHUP: "HUP", syscall.SIGINT: "INT", syscall.SIGQUIT: "QUIT", syscall.SIGILL: "ILL",
	syscall.SIGABRT: "ABRT", syscall.SIGFPE: "FPE", syscall.SIGKILL: "KILL", syscall.SIGUSR1: "USR1",
	syscall.SIGSEGV: "SEGV", syscall.SIGUSR2: "USR2", syscall.SIGPIPE: "PIPE", syscall.SIGALRM: "ALRM",
	syscall.SIGTERM: "TERM",
}

func signalNumber(name string) int {
	for s, n := range signalNames {
		if n == name {
			return int(s)
		}
	}
	return 0
}

// firstLine is the first line of file, "" when it cannot be read.
func firstLine(file string) string {
	b, err := os.ReadFile(file)
	if err != nil {
		return ""
	}
	line, _, _ := strings.Cut(string(b), "\n")
	return strings.TrimSpace(line)
}

// forwardedPush is a pushRequest whose entries the helper passes on
// undecoded (the server decodes them).
type forwardedPush struct {
	Head    string          `json:"head"`
	Entries json.RawMessage `json:"entries"`
	Time    int64           `json:"time"`
	SnapRef string          `json:"snap_ref"`
	BaseRef string          `json:"base_ref"`
}

// withPath is env with PATH set to path.
func withPath(env []string, path string) []string {
	out := make([]string, 0, len(env)+1)
	for _, kv := range env {
		if !strings.HasPrefix(kv, "PATH=") {
			out = append(out, kv)
		}
	}
	return append(out, "PATH="+path)
}

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

	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// maxScriptOutput bounds what the helper keeps of a push or pull script's
// stderr, and of the push script's stdout beyond the patch bound.
const maxScriptOutput = 64 << 10

// Exchange is the verb `exchange` (the protocol in package helperproto):
// it reads the daemon's frames on in and writes its own on out, which no
// other process writes. It pushes (natively through the server, or by the
// request's push script), says Started, runs the user's command with pipes
// of its own in a session of its own, frames its output, reports its exit,
// then pulls (natively, or by the pull script) and sends the patch.
//
// Before anything, it makes itself non-dumpable: a command of the same uid
// then cannot open /proc/<helper>/fd/1 (the channel), read its memory or
// ptrace it. The command's own process is dumpable again (execve resets
// it), so nothing changes for it.
func Exchange(ctx context.Context, o ExchangeOptions, in io.Reader, out io.Writer, log io.Writer) int {
	undumpable()
	// Signals the agent relays to this exec go to the command; a write to
	// a channel that went away fails instead of killing the helper, so the
	// pull still leaves the edits in the sandbox.
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGHUP, syscall.SIGINT, syscall.SIGQUIT, syscall.SIGTERM, syscall.SIGPIPE)
	defer signal.Stop(sigs)
	ctx = context.WithoutCancel(ctx)

	x := &exchange{state: o.State, pushEnv: o.PushEnv, fw: &helperproto.FrameWriter{W: out}, log: log}
	fr := &helperproto.FrameReader{R: in}
	typ, p, err := fr.Next()
	var hello helperproto.Hello
	if err == nil && typ == helperproto.FrameHello {
		err = helperproto.Decode(typ, p, &hello)
	} else if err == nil {
		err = fmt.Errorf("expected a hello frame, got %q", typ)
	}
	if err != nil || !slices.Contains(hello.Versions, helperproto.Version) {
		_ = x.send(helperproto.FrameHelloAnswer, helperproto.HelloAnswer{})
		fmt.Fprintf(log, "%s exchange: no common version (%v, %v)\n", Name, hello.Versions, err)
		return exitUsage
	}
	if err := x.send(helperproto.FrameHelloAnswer, helperproto.HelloAnswer{Version: helperproto.Version}); err != nil {
		return exitFailed
	}
	typ, p, err = fr.Next()
	if err == nil && typ != helperproto.FrameRequest {
		err = fmt.Errorf("expected a request frame, got %q", typ)
	}
	var req helperproto.ExchangeRequest
	if err == nil {
		err = helperproto.Decode(typ, p, &req)
	}
	if err != nil {
		x.decline("read the request: " + err.Error())
		return exitUsage
	}
	// The command's PATH is the sandbox's own (the exec's shell added
	// git's usual places to its PATH).
	req.Path = o.Path
	started, ok := x.push(ctx, &req)
	if !ok {
		return 0
	}
	if err := x.send(helperproto.FrameStarted, started); err != nil {
		// Nobody listens: the command does not start.
		return exitFailed
	}
	exit := x.run(&req, fr, sigs)
	if err := x.send(helperproto.FrameExit, exit); err != nil {
		fmt.Fprintf(log, "%s exchange: %v\n", Name, err)
	}
	x.pull(ctx, &req, started)
	_ = x.fw.Write(helperproto.FrameEnd, nil)
	return 0
}

// ExchangeOptions are what the exchange's own shell found before it
// became the helper.
type ExchangeOptions struct {
	// State is the sync state directory (.git/sandboxd); Path the
	// sandbox's own PATH, the command's.
	State, Path string
	// PushEnv are variables for the push script only (what strayEdits
	// learnt: the patch of stray edits it made, the tree it staged).
	PushEnv []string
}

type exchange struct {
	state   string
	pushEnv []string
	log     io.Writer
	mu      sync.Mutex
	fw      *helperproto.FrameWriter
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
// declines) by the push script. ok false: the answer (Declined or
// PushFailed) was sent and nothing runs.
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
	var stdout, stderr bytes.Buffer
	cmd := exec.Command("/bin/sh", "-c", req.PushScript)
	cmd.Env = append(os.Environ(), x.pushEnv...)
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
	// The push script prints the snapshot, the tree the sync index holds
	// and whether the server adopted it ("1": the pull is native).
	lines := strings.SplitN(stdout.String(), "\n", 4)
	for len(lines) < 3 {
		lines = append(lines, "")
	}
	st := helperproto.Started{Snapshot: strings.TrimSpace(lines[0]), Native: strings.TrimSpace(lines[2]) == "1"}
	if st.Native {
		x.tree = strings.TrimSpace(lines[1])
	}
	return st, true
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
		cmd.Env = withPath(os.Environ(), req.Path)
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
		// The daemon's frames: stdin, its end, signals. The channel's end
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
	var stderr bytes.Buffer
	pw := &pullWriter{x: x}
	cmd := exec.Command("/bin/sh", "-c", req.PullScript)
	cmd.Stdout, cmd.Stderr = pw, &capped{buf: &stderr, max: maxScriptOutput}
	code := status(cmd.Run())
	c := code.Code
	if code.Signal != "" {
		c = 128 + signalNumber(code.Signal)
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
	size, code := fi.Size(), 0
	if _, err := fmt.Fprintf(pw, "%s%s %d\n", PullHeader, id, size); err != nil {
		return err
	}
	if size > req.Max {
		code = ExitPullTooLarge
	} else if n, err := io.Copy(pw, io.LimitReader(f, size)); err != nil || n != size {
		return fmt.Errorf("send the pull's patch (%d of %d bytes): %v", n, size, err)
	}
	return x.send(helperproto.FramePullEnd, helperproto.PullEnd{Code: code})
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

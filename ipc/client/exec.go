package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// stdinChunk is the most stdin bytes sent in one frame.
const stdinChunk = 32 << 10

// ExecOptions are the caller's side of an exec's streams.
type ExecOptions struct {
	// Stdin, when set, is forwarded to the command until it returns EOF.
	// Exec does not wait for a Read that is still blocked when the command
	// ends (a terminal, say): that goroutine ends with the Read.
	Stdin io.Reader
	// Stdout and Stderr receive the command's output as it comes; nil
	// discards it.
	Stdout, Stderr io.Writer
	// Signals are forwarded to the command ("INT", "TERM", ...).
	Signals <-chan string
	// TTY runs the command on a pseudo-terminal (stdout and stderr come
	// as one stream, to Stdout); Resizes then carries the caller's new
	// window sizes.
	TTY     *ipc.TTY
	Resizes <-chan ipc.WindowSize
	// OnFrame sees the queued, started and warning frames.
	OnFrame func(ipc.ExecOutput)
}

// Exec is POST /v1/exec: it runs req.Argv in the sandbox, streaming stdin and
// signals up and stdout and stderr down, and returns the command's result.
// Cancelling ctx disconnects, which cancels a queued or running command.
// A failure before the command ran is a kinded error with the daemon's
// message; so is a failure after it started (its outcome is then unknown).
func (c *Client) Exec(ctx context.Context, req ipc.ExecRequest, opts ExecOptions) (ipc.ExecResult, error) {
	first, err := execRequest(req, opts)
	if err != nil {
		return ipc.ExecResult{}, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// The connection closes when ctx ends, which cancels a queued or
	// running command.
	r := request{method: http.MethodPost, path: pathExec, contentType: ipc.ContentTypeNDJSON,
		// Output as binary frames, without base64; a daemon that does not
		// know the header answers NDJSON, which is read as well.
		header: http.Header{ipc.HeaderExecFrames: {ipc.ExecFramesBinary}}}
	var up *uplink
	if opts.Stdin != nil || opts.Signals != nil || opts.Resizes != nil {
		// The request body is a stream the uplink writes into while the
		// answer streams back: net/http's transport sends it chunked, each
		// read of the pipe one chunk, flushed at once.
		pr, pw := io.Pipe()
		up = &uplink{pw: pw, done: make(chan struct{})}
		r.body, r.length = pr, -1
		// The transport waits for the body's writer before it reports a
		// connection that failed before the answer; that writer may be
		// waiting for stdin that never comes (a terminal). The
		// connection's close ends the body.
		r.onConnClose = func() { pr.CloseWithError(errConnClosed) }
		go up.run(ctx, first, opts.Stdin, opts.Signals, opts.Resizes)
		defer up.stop()
	} else {
		// Nothing will follow the request: one plain body.
		body := append(first, '\n')
		r.body, r.length = bytes.NewReader(body), int64(len(body))
	}
	resp, err := c.send(ctx, r)
	if err != nil {
		switch {
		case connectFailed(err) || ctx.Err() != nil:
			return ipc.ExecResult{}, transportError(ctx, r.method, r.path, err)
		case up != nil && up.failed() != nil:
			return ipc.ExecResult{}, up.failed()
		}
		return ipc.ExecResult{}, errdefs.Unavailable(fmt.Errorf("sandboxd closed the connection before answering (did it die or restart?): the command had not been reported started, so it most likely did not run; check `nook daemon status`, then run it again: %w", unwrapURL(err)))
	}
	// The body is never read to its end: the daemon ends it only after it
	// saw this request end. Closing it closes the connection.
	defer resp.Body.Close()
	if err := c.received(resp, false); err != nil {
		return ipc.ExecResult{}, err
	}
	var frames frameSource = ndjsonFrames{json.NewDecoder(resp.Body)}
	if resp.Header.Get("Content-Type") == ipc.ContentTypeExecFrames {
		frames = binaryFrames{ipc.NewFrameReader(resp.Body)}
	}
	res, err := c.readExec(ctx, frames, resp.StatusCode, opts, up)
	if up != nil {
		// End the request stream cleanly before the connection closes.
		up.stop()
	}
	return res, err
}

// errConnClosed ends an exec's request stream whose connection closed.
var errConnClosed = errors.New("the connection to sandboxd closed")

// pathExec is the exec's route.
const pathExec = "/v1/exec"

// execRequest is the first line of an exec's request stream: req with the
// streams opts gives.
func execRequest(req ipc.ExecRequest, opts ExecOptions) ([]byte, error) {
	req.Stdin = opts.Stdin != nil
	req.TTY = opts.TTY
	if err := req.CheckText(); err != nil {
		return nil, err
	}
	first, err := json.Marshal(req)
	if err != nil {
		return nil, errdefs.Invalidf("encode the exec request: %v", err)
	}
	return first, nil
}

// frameSource yields an exec's answer frame by frame. A frame's Data is
// valid until the next call.
type frameSource interface {
	next() (ipc.ExecOutput, error)
}

// ndjsonFrames reads the answer as NDJSON.
type ndjsonFrames struct{ dec *json.Decoder }

func (n ndjsonFrames) next() (f ipc.ExecOutput, err error) {
	err = n.dec.Decode(&f)
	return f, err
}

// binaryFrames reads the answer as binary frames (ipc.HeaderExecFrames).
type binaryFrames struct{ fr *ipc.FrameReader }

func (b binaryFrames) next() (f ipc.ExecOutput, err error) {
	kind, payload, err := b.fr.Next()
	switch {
	case err != nil:
		return f, err
	case kind == ipc.FrameStdout:
		return ipc.ExecOutput{Type: ipc.ExecStdout, Data: payload}, nil
	case kind == ipc.FrameStderr:
		return ipc.ExecOutput{Type: ipc.ExecStderr, Data: payload}, nil
	}
	if err := json.Unmarshal(payload, &f); err != nil {
		return f, fmt.Errorf("%w: a control frame that is not an exec frame's JSON: %w", ipc.ErrFrame, err)
	}
	return f, nil
}

// readExec relays output frames until the final one.
func (c *Client) readExec(ctx context.Context, frames frameSource, status int, opts ExecOptions, up *uplink) (ipc.ExecResult, error) {
	started := false
	for {
		f, err := frames.next()
		if err != nil {
			if up != nil && up.failed() != nil {
				return ipc.ExecResult{}, up.failed()
			}
			if ctx.Err() != nil {
				return ipc.ExecResult{}, transportError(ctx, http.MethodPost, pathExec, err)
			}
			if !started {
				return ipc.ExecResult{}, errdefs.Unavailable(fmt.Errorf("sandboxd's answer ended before the command started (did the daemon die or restart?): the command most likely did not run; check `nook daemon status`, then run it again: %w", err))
			}
			return ipc.ExecResult{}, errdefs.Unavailable(fmt.Errorf("sandboxd's answer ended after the command started and before its result (did the daemon die or restart?): the command may have run, in full or in part, and its edits were not brought back; check the sandbox before running it again: %w", err))
		}
		if f.Type == ipc.ExecStarted {
			started = true
		}
		switch f.Type {
		case ipc.ExecStdout:
			if err := write(opts.Stdout, f.Data); err != nil {
				return ipc.ExecResult{}, fmt.Errorf("write the command's stdout: %w", err)
			}
		case ipc.ExecStderr:
			if err := write(opts.Stderr, f.Data); err != nil {
				return ipc.ExecResult{}, fmt.Errorf("write the command's stderr: %w", err)
			}
		case ipc.ExecExit:
			if f.Result == nil {
				return ipc.ExecResult{}, errdefs.Internal(errors.New("the daemon sent an exit frame without a result"))
			}
			return *f.Result, nil
		case ipc.ExecError:
			d := ipc.ErrorDetail{Code: string(errdefs.KindInternal), Message: "the daemon sent an error frame without an error"}
			if f.Error != nil {
				d = *f.Error
			}
			return ipc.ExecResult{}, apiError(status, d)
		default:
			// queued, started, warning, and frame types added later.
			if opts.OnFrame != nil {
				opts.OnFrame(f)
			}
		}
	}
}

func write(w io.Writer, p []byte) error {
	if w == nil {
		return nil
	}
	_, err := w.Write(p)
	return err
}

// uplink writes the request stream: the request line, then stdin, signal
// and resize frames. Closing pw ends the stream cleanly (the transport
// sends the last chunk); CloseWithError abandons it (the transport closes
// the connection without one, so the daemon sees the stream broken, not
// complete).
type uplink struct {
	pw   *io.PipeWriter
	done chan struct{}
	once sync.Once

	mu  sync.Mutex
	err error // why the uplink failed, if it did
}

func (u *uplink) stop() {
	u.once.Do(func() { close(u.done) })
	_ = u.pw.Close()
}

func (u *uplink) failed() error {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.err
}

func (u *uplink) fail(err error) {
	u.mu.Lock()
	if u.err == nil {
		u.err = err
	}
	u.mu.Unlock()
}

func (u *uplink) run(ctx context.Context, first []byte, stdin io.Reader, signals <-chan string, resizes <-chan ipc.WindowSize) {
	// However the uplink ends, the request stream ends with it: with the
	// last chunk, unless it was abandoned (the daemon then sees it broken).
	defer u.pw.Close()
	enc := func(v ipc.ExecInput) bool {
		b, err := json.Marshal(v)
		if err != nil {
			u.fail(errdefs.Invalidf("encode an exec frame: %v", err))
			_ = u.pw.CloseWithError(err)
			return false
		}
		_, err = u.pw.Write(append(b, '\n'))
		return err == nil
	}
	if _, err := u.pw.Write(append(first, '\n')); err != nil {
		return
	}
	var chunks chan []byte
	readErr := make(chan error, 1)
	if stdin != nil {
		chunks = make(chan []byte)
		go pumpStdin(stdin, chunks, readErr, u.done)
	}
	for {
		select {
		case <-u.done:
			return
		case <-ctx.Done():
			return
		case ws, ok := <-resizes:
			if !ok {
				resizes = nil
				continue
			}
			if !enc(ipc.ExecInput{Resize: &ws}) {
				return
			}
		case sig, ok := <-signals:
			if !ok {
				signals = nil
				if chunks == nil {
					_ = u.pw.Close()
					return
				}
				continue
			}
			if !enc(ipc.ExecInput{Signal: sig}) {
				return
			}
		case b, ok := <-chunks:
			if !ok {
				chunks = nil
				if err := <-readErr; err != nil {
					u.fail(fmt.Errorf("read stdin to forward it: %w", err))
					_ = u.pw.CloseWithError(err)
					return
				}
				if !enc(ipc.ExecInput{StdinEOF: true}) {
					return
				}
				if signals == nil {
					_ = u.pw.Close()
					return
				}
				continue
			}
			if !enc(ipc.ExecInput{Stdin: b}) {
				return
			}
		}
	}
}

// pumpStdin reads r into chunks until EOF (closing chunks, with the read
// error in errc) or until done.
func pumpStdin(r io.Reader, chunks chan<- []byte, errc chan<- error, done <-chan struct{}) {
	defer close(chunks)
	for {
		buf := make([]byte, stdinChunk)
		n, err := r.Read(buf)
		if n > 0 {
			select {
			case chunks <- buf[:n]:
			case <-done:
				errc <- nil
				return
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = nil
			}
			errc <- err
			return
		}
	}
}

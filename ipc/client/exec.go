package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
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
	const path = "/v1/exec"
	// The connection closes when ctx ends, which cancels a queued or
	// running command.
	cc, err := c.connect(ctx, methodPost, path)
	if err != nil {
		return ipc.ExecResult{}, err
	}
	defer cc.close()

	r := request{method: methodPost, path: path, contentType: ipc.ContentTypeNDJSON}
	streaming := opts.Stdin != nil || opts.Signals != nil || opts.Resizes != nil
	if streaming {
		r.chunked = true
	} else {
		// Nothing will follow the request: one plain body.
		r.body = append(first, '\n')
	}
	if _, err := cc.Write(appendRequest(nil, r, c.userAgent)); err != nil {
		return ipc.ExecResult{}, transportError(ctx, methodPost, path, err)
	}
	var up *uplink
	if streaming {
		// Each frame the uplink writes goes out as one chunk, written by
		// the uplink itself: no pipe, no copying goroutine.
		up = &uplink{pw: &chunkedConn{w: cc.conn}, done: make(chan struct{})}
		go up.run(ctx, first, opts.Stdin, opts.Signals, opts.Resizes)
		defer up.stop()
	}
	resp, err := readResponse(cc.br)
	if err != nil {
		if up != nil && up.failed() != nil && ctx.Err() == nil {
			return ipc.ExecResult{}, up.failed()
		}
		if ctx.Err() == nil {
			return ipc.ExecResult{}, errdefs.Unavailable(fmt.Errorf("sandboxd closed the connection before answering (did it die or restart?): the command had not been reported started, so it most likely did not run; check `nook daemon status`, then run it again: %w", err))
		}
		return ipc.ExecResult{}, transportError(ctx, methodPost, path, err)
	}
	// The body is never read to its end: the daemon ends it only after it
	// saw this request end. The connection's close ends both.
	if err := c.received(resp, false); err != nil {
		return ipc.ExecResult{}, err
	}
	res, err := c.readExec(ctx, resp.body, resp.status, opts, up)
	if up != nil {
		// End the request stream cleanly before the connection closes.
		up.stop()
	}
	return res, err
}

// execRequest is the first line of an exec's request stream: req with the
// streams opts gives.
func execRequest(req ipc.ExecRequest, opts ExecOptions) ([]byte, error) {
	req.Stdin = opts.Stdin != nil
	req.TTY = opts.TTY
	if err := req.CheckText(); err != nil {
		return nil, err
	}
	if first, ok := appendExecRequest(nil, req); ok {
		return first, nil
	}
	first, err := json.Marshal(req)
	if err != nil {
		return nil, errdefs.Invalidf("encode the exec request: %v", err)
	}
	return first, nil
}

// readExec relays output frames until the final one.
func (c *Client) readExec(ctx context.Context, body io.Reader, status int, opts ExecOptions, up *uplink) (ipc.ExecResult, error) {
	frames := frameReader{br: bufio.NewReaderSize(body, 32<<10)}
	started := false
	for {
		f, err := frames.next()
		if err != nil {
			if up != nil && up.failed() != nil {
				return ipc.ExecResult{}, up.failed()
			}
			if ctx.Err() != nil {
				return ipc.ExecResult{}, transportError(ctx, methodPost, "/v1/exec", err)
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

var errUplinkDone = errors.New("exec request stream ended")

// uplinkWriter is where an uplink writes its frames: the connection itself,
// a chunk a frame (chunkedConn). Close and CloseWithError(errUplinkDone)
// end the stream cleanly; another error abandons it.
type uplinkWriter interface {
	io.Writer
	Close() error
	CloseWithError(err error) error
}

// uplink writes the request stream: the request line, then stdin and
// signal frames.
type uplink struct {
	pw   uplinkWriter
	done chan struct{}
	once sync.Once

	mu  sync.Mutex
	err error // why the uplink failed, if it did
}

func (u *uplink) stop() {
	u.once.Do(func() { close(u.done) })
	_ = u.pw.CloseWithError(errUplinkDone)
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
	defer u.pw.CloseWithError(errUplinkDone)
	enc := func(v ipc.ExecInput) bool {
		b, ok := appendExecInput(nil, v)
		if !ok {
			var err error
			if b, err = json.Marshal(v); err != nil {
				u.fail(errdefs.Invalidf("encode an exec frame: %v", err))
				return false
			}
		}
		_, err := u.pw.Write(append(b, '\n'))
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

// chunkedConn is the request body of a streaming Exec: each Write is
// one HTTP/1.1 chunk on the connection, and ending the stream cleanly
// writes the last chunk, once.
type chunkedConn struct {
	mu     sync.Mutex
	w      io.Writer
	closed bool
}

func (c *chunkedConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return 0, io.ErrClosedPipe
	}
	if len(p) == 0 {
		return 0, nil
	}
	buf := make([]byte, 0, len(p)+20)
	buf = strconv.AppendInt(buf, int64(len(p)), 16)
	buf = append(buf, "\r\n"...)
	buf = append(buf, p...)
	buf = append(buf, "\r\n"...)
	if _, err := c.w.Write(buf); err != nil {
		c.closed = true
		return 0, err
	}
	return len(p), nil
}

func (c *chunkedConn) Close() error { return c.CloseWithError(nil) }

// CloseWithError ends the body: with the last chunk when err is nil or
// errUplinkDone, abandoned otherwise (the connection's close tells).
func (c *chunkedConn) CloseWithError(err error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	if err != nil && !errors.Is(err, errUplinkDone) {
		return nil
	}
	_, werr := io.WriteString(c.w, "0\r\n\r\n")
	return werr
}

// frameReader reads the exec's answer, a stream of JSON frames: one a line
// from this daemon, which the hand decoder takes; from the first frame it
// does not take, encoding/json reads the rest, as it once read the whole
// stream.
type frameReader struct {
	br   *bufio.Reader
	long []byte
	dec  *json.Decoder
}

func (r *frameReader) next() (f ipc.ExecOutput, err error) {
	if r.dec != nil {
		err = r.dec.Decode(&f)
		return f, err
	}
	for {
		line, err := r.br.ReadSlice('\n')
		if err == bufio.ErrBufferFull {
			// A frame longer than the buffer (a large chunk of output).
			r.long = append(r.long[:0], line...)
			for err == bufio.ErrBufferFull {
				line, err = r.br.ReadSlice('\n')
				r.long = append(r.long, line...)
			}
			line = r.long
		}
		if len(bytes.TrimSpace(line)) == 0 {
			if err != nil {
				return f, err
			}
			continue
		}
		if f, ok := decodeExecOutput(line); ok {
			return f, nil
		}
		r.dec = json.NewDecoder(io.MultiReader(bytes.NewReader(append([]byte(nil), line...)), r.br))
		err = r.dec.Decode(&f)
		return f, err
	}
}

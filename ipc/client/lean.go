package client

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// ExecLean is Exec without net/http's client machinery (no transport, no
// connection pool, no per-connection read and write goroutines): one Unix
// socket connection for this exec, the request written as HTTP/1.1 by hand,
// the response parsed off the connection. It is for one-shot processes
// such as sbx, where each exec is the whole life of the program; the
// semantics (frames, errors, cancellation) are those of Exec.
func (c *Client) ExecLean(ctx context.Context, req ipc.ExecRequest, opts ExecOptions) (ipc.ExecResult, error) {
	first, err := execRequest(req, opts)
	if err != nil {
		return ipc.ExecResult{}, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	conn, err := c.dial(ctx, "unix", c.socket)
	if err != nil {
		return ipc.ExecResult{}, transportError(ctx, http.MethodPost, "/v1/exec", err)
	}
	// Cancelling disconnects, which cancels a queued or running command.
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	defer conn.Close()

	streaming := opts.Stdin != nil || opts.Signals != nil || opts.Resizes != nil
	var head bytes.Buffer
	head.WriteString("POST /v1/exec HTTP/1.1\r\nHost: sandboxd\r\nUser-Agent: ")
	head.WriteString(headerSafe(c.userAgent))
	head.WriteString("\r\nContent-Type: " + ipc.ContentTypeNDJSON + "\r\nConnection: close\r\n")
	if streaming {
		head.WriteString("Transfer-Encoding: chunked\r\n\r\n")
	} else {
		// Nothing will follow the request: one plain body.
		fmt.Fprintf(&head, "Content-Length: %d\r\n\r\n", len(first)+1)
		head.Write(first)
		head.WriteByte('\n')
	}
	if _, err := conn.Write(head.Bytes()); err != nil {
		return ipc.ExecResult{}, transportError(ctx, http.MethodPost, "/v1/exec", err)
	}
	var up *uplink
	if streaming {
		// Each frame the uplink writes goes out as one chunk, written by
		// the uplink itself: no pipe, no copying goroutine.
		up = &uplink{pw: &chunkedConn{w: conn}, done: make(chan struct{})}
		go up.run(ctx, first, opts.Stdin, opts.Signals, opts.Resizes)
		defer up.stop()
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		if up != nil && up.failed() != nil && ctx.Err() == nil {
			return ipc.ExecResult{}, up.failed()
		}
		if ctx.Err() == nil {
			return ipc.ExecResult{}, errdefs.Unavailable(fmt.Errorf("sandboxd closed the connection before answering (did it die or restart?): the command had not been reported started, so it most likely did not run; check `sbx daemon status`, then run it again: %w", err))
		}
		return ipc.ExecResult{}, transportError(ctx, http.MethodPost, "/v1/exec", err)
	}
	// The body is never closed: closing it would read it to its end, which
	// the daemon writes only after it saw this request end. The
	// connection's close ends both.
	if v := resp.Header.Get(ipc.HeaderVersion); v != "" {
		c.daemonVersion.Store(&v)
	}
	if v := resp.Header.Get(ipc.HeaderWarning); v != "" {
		c.warning.Store(&v)
	}
	if resp.StatusCode/100 != 2 {
		return ipc.ExecResult{}, decodeError(resp)
	}
	res, err := c.readExec(ctx, resp.Body, resp.StatusCode, opts, up)
	if up != nil {
		// End the request stream cleanly before the connection closes.
		up.stop()
	}
	return res, err
}

// chunkedConn is the request body of a streaming ExecLean: each Write is
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

// headerSafe drops what could end a header line.
func headerSafe(s string) string {
	return strings.Map(func(r rune) rune {
		if r == '\r' || r == '\n' {
			return -1
		}
		return r
	}, s)
}

package mcp

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	sdk "github.com/modelcontextprotocol/go-sdk/mcp"
)

// maxLine bounds one JSON-RPC message on stdin: an exec's stdin travels in
// one, so it is generous, but a client that never ends a line must not make
// the server hold all it sends.
const maxLine = 16 << 20

// JSON-RPC 2.0 error codes answered for input the SDK would not survive.
const (
	codeParseError     = -32700
	codeInvalidRequest = -32600
)

// Serve runs the server on stdio until the client disconnects or ctx ends.
func Serve(ctx context.Context, opts Options) error {
	return ServeIO(ctx, opts, os.Stdin, os.Stdout)
}

// ServeIO runs the server on in and out (newline-delimited JSON-RPC) until
// in ends or ctx does. A line that is not JSON is answered with a parse
// error (-32700), one that is not a JSON-RPC message (a batch among them:
// MCP no longer has batches) with an invalid-request error (-32600), and
// the server goes on serving: the SDK's own transport ends the session on
// the first such line, leaving the client's later requests unanswered.
func ServeIO(ctx context.Context, opts Options, in io.Reader, out io.Writer) error {
	if opts.Checkout != "" && !opts.AnyCheckout {
		if _, ok := checkoutOf(opts.Checkout); !ok {
			return fmt.Errorf("--checkout %s is not inside a git checkout: give a directory of the checkout to confine the server to", opts.Checkout)
		}
	}
	w := &lockedWriter{w: out}
	pr, pw := io.Pipe()
	filtered := make(chan error, 1)
	go func() {
		err := filterLines(in, pw, w)
		pw.CloseWithError(err)
		filtered <- err
	}()
	ss, err := NewServer(opts).Connect(ctx, &sdk.IOTransport{Reader: pr, Writer: w}, nil)
	if err != nil {
		pr.Close()
		return fmt.Errorf("serve MCP on stdio: %w", err)
	}
	ended := make(chan struct{})
	go func() {
		// However the session ends (the client closes stdin), that is the
		// end of this server's job.
		_ = ss.Wait()
		close(ended)
	}()
	select {
	case <-ended:
	case <-ctx.Done():
		_ = ss.Close()
		<-ended
	}
	pr.Close() // ends filterLines' next write
	select {
	case err := <-filtered:
		if err != nil && !errors.Is(err, io.ErrClosedPipe) {
			return fmt.Errorf("serve MCP on stdio: %w", err)
		}
	case <-time.After(100 * time.Millisecond): // still reading stdin: the session ended first
	}
	return nil
}

// filterLines copies the JSON-RPC messages of in to pass, one per line,
// and answers every other line on out itself.
func filterLines(in io.Reader, pass io.Writer, out io.Writer) error {
	r := bufio.NewReaderSize(in, 64<<10)
	for {
		line, tooLong, err := readLine(r)
		if len(bytes.TrimSpace(line)) > 0 || tooLong {
			if reply := check(line, tooLong); reply != nil {
				if _, werr := out.Write(reply); werr != nil {
					return werr
				}
			} else if _, werr := pass.Write(append(line, '\n')); werr != nil {
				return werr
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
	}
}

// readLine reads one line without its end, keeping at most maxLine bytes
// (tooLong says the rest was skipped).
func readLine(r *bufio.Reader) (line []byte, tooLong bool, err error) {
	for {
		chunk, err := r.ReadSlice('\n')
		if !tooLong {
			if len(line)+len(chunk) > maxLine+1 {
				tooLong, line = true, nil
			} else {
				line = append(line, chunk...)
			}
		}
		if errors.Is(err, bufio.ErrBufferFull) {
			continue
		}
		return bytes.TrimRight(line, "\r\n"), tooLong, err
	}
}

// check returns the error answer of a line that is not one JSON-RPC
// message, or nil for a message to serve.
func check(line []byte, tooLong bool) []byte {
	if tooLong {
		return errorReply(nil, codeParseError, fmt.Sprintf("parse error: a message longer than %d bytes", maxLine))
	}
	if !json.Valid(line) {
		return errorReply(nil, codeParseError, "parse error: the line is not JSON")
	}
	trimmed := bytes.TrimSpace(line)
	if trimmed[0] != '{' {
		return errorReply(nil, codeInvalidRequest, "invalid request: a JSON-RPC message is an object (batches are not supported)")
	}
	if _, err := jsonrpc.DecodeMessage(trimmed); err != nil {
		return errorReply(idOf(trimmed), codeInvalidRequest, "invalid request: "+err.Error())
	}
	return nil
}

// idOf is the id of a malformed message when it is a valid JSON-RPC id (a
// string or a number), so that its error can be matched; else null.
func idOf(msg []byte) json.RawMessage {
	var m struct {
		ID json.RawMessage `json:"id"`
	}
	if json.Unmarshal(msg, &m) != nil || len(m.ID) == 0 {
		return nil
	}
	var s string
	var n json.Number
	if json.Unmarshal(m.ID, &s) == nil || json.Unmarshal(m.ID, &n) == nil {
		return m.ID
	}
	return nil
}

func errorReply(id json.RawMessage, code int, message string) []byte {
	if id == nil {
		id = json.RawMessage("null")
	}
	b, _ := json.Marshal(struct {
		JSONRPC string          `json:"jsonrpc"`
		ID      json.RawMessage `json:"id"`
		Error   struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		} `json:"error"`
	}{JSONRPC: "2.0", ID: id, Error: struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}{code, message}})
	return append(b, '\n')
}

// lockedWriter serializes whole messages of the SDK and of filterLines on
// one stream; closing it leaves the stream open.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

func (l *lockedWriter) Close() error { return nil }

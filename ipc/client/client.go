// Package client is the one typed Go client of sandboxd's socket API, used by
// nook, editor integrations and the tests. Errors come back as errdefs kinds
// (errors.Is(err, errdefs.ErrNotFound)) carrying the daemon's message; a
// daemon that is not running is a *NotRunningError.
//
// Each call has a connection of its own, closed when the call ends: the
// daemon is on this machine, so a connection costs microseconds, and no
// pool outlives a call. Cancelling a call's context closes its connection,
// which is how the daemon learns that the caller went away (a running exec
// is then cancelled).
package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// maxSocketPath is the room in sockaddr_un.sun_path (108 with the NUL).
const maxSocketPath = 107

// maxErrorBody bounds how much of an error answer is read.
const maxErrorBody = 64 << 10

// Request methods.
const (
	methodGet  = "GET"
	methodPost = "POST"
)

// Client talks to one sandboxd socket. It is safe for concurrent use.
type Client struct {
	socket      string
	dialTimeout time.Duration
	userAgent   string

	daemonVersion atomic.Pointer[string]
	warning       atomic.Pointer[string]
}

// Warning is the last Sandboxd-Warning the daemon sent ("" for none).
func (c *Client) Warning() string {
	if p := c.warning.Load(); p != nil {
		return *p
	}
	return ""
}

// Option configures a Client.
type Option func(*Client)

// WithDialTimeout bounds connecting to the socket (default 5s).
func WithDialTimeout(d time.Duration) Option { return func(c *Client) { c.dialTimeout = d } }

// WithUserAgent names the caller in requests (default "sandboxd-client").
func WithUserAgent(ua string) Option { return func(c *Client) { c.userAgent = ua } }

// New returns a client for the daemon listening on socketPath. It does not
// connect until the first call. No call has an overall timeout (exec and
// events are long streams, start --wait may take minutes): callers bound
// calls with their context.
func New(socketPath string, opts ...Option) *Client {
	c := &Client{socket: socketPath, dialTimeout: 5 * time.Second, userAgent: "sandboxd-client"}
	for _, o := range opts {
		o(c)
	}
	return c
}

// SocketPath is the socket this client talks to.
func (c *Client) SocketPath() string { return c.socket }

// DaemonVersion is the Sandboxd-Version header of the last answer, or "" when
// the daemon has not answered yet.
func (c *Client) DaemonVersion() string {
	if v := c.daemonVersion.Load(); v != nil {
		return *v
	}
	return ""
}

// Close releases what the client holds between calls: nothing, as each
// call's connection ends with the call. It is kept for callers written for
// a pooling client.
func (c *Client) Close() {}

// dial connects to the socket and checks that this user's daemon serves it
// before anything is sent.
func (c *Client) dial(ctx context.Context) (*os.File, error) {
	if len(c.socket) > maxSocketPath {
		return nil, errdefs.Invalidf("socket path %s is %d bytes, longer than the %d a Unix socket allows: set SANDBOXD_SOCKET or XDG_RUNTIME_DIR to a shorter path", c.socket, len(c.socket), maxSocketPath)
	}
	conn, err := dialUnix(ctx, c.socket, c.dialTimeout)
	if err != nil {
		if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
			return nil, &NotRunningError{Socket: c.socket, Err: err}
		}
		return nil, errdefs.Unavailable(fmt.Errorf("connect to sandboxd at %s: %w", c.socket, err))
	}
	if err := verifyDaemon(conn, c.socket); err != nil {
		conn.Close()
		return nil, err
	}
	return conn, nil
}

// conn is a call's connection as a plain stream. Not the *os.File itself:
// its WriteTo and ReadFrom would let io.Copy read past the bytes br holds.
type conn interface {
	io.ReadWriteCloser
	SetDeadline(time.Time) error
}

// callConn is the connection of one call.
type callConn struct {
	conn
	br   *bufio.Reader
	stop func() bool // unties the connection from the call's context
}

// connect opens the connection of a call, closed when ctx ends before the
// call closes it.
func (c *Client) connect(ctx context.Context, method, path string) (*callConn, error) {
	conn, err := c.dial(ctx)
	if err != nil {
		return nil, transportError(ctx, method, path, err)
	}
	cc := &callConn{conn: conn, br: bufio.NewReader(conn)}
	cc.stop = context.AfterFunc(ctx, func() { conn.Close() })
	return cc, nil
}

// close ends the call's connection.
func (cc *callConn) close() {
	cc.stop()
	cc.conn.Close()
}

// roundTrip sends r on a connection of its own and returns its answer, and
// the connection, which the caller closes once it has read the body. An
// answer other than 2xx (or 101 to an upgrade) is returned as its error.
func (c *Client) roundTrip(ctx context.Context, r request) (*response, *callConn, error) {
	cc, err := c.connect(ctx, r.method, r.path)
	if err != nil {
		return nil, nil, err
	}
	if _, err := cc.Write(appendRequest(nil, r, c.userAgent)); err != nil {
		cc.close()
		return nil, nil, transportError(ctx, r.method, r.path, err)
	}
	resp, err := readResponse(cc.br)
	if err != nil {
		cc.close()
		return nil, nil, transportError(ctx, r.method, r.path, err)
	}
	if err := c.received(resp, r.upgrade != ""); err != nil {
		cc.close()
		return nil, nil, err
	}
	return resp, cc, nil
}

// received records what every answer's head tells and returns the error
// of an answer that is not a success.
func (c *Client) received(resp *response, upgrade bool) error {
	if v := resp.header.get(ipc.HeaderVersion); v != "" {
		c.daemonVersion.Store(&v)
	}
	if v := resp.header.get(ipc.HeaderWarning); v != "" {
		c.warning.Store(&v)
	}
	switch {
	case resp.status == 101 && upgrade, resp.status/100 == 2:
		return nil
	case resp.status == 101:
		return errdefs.Internal(errors.New("sandboxd answered 101 Switching Protocols to a request that asked for no upgrade: is another program serving the socket? (nook version)"))
	}
	return decodeError(resp)
}

// ErrDaemonNotRunning matches a *NotRunningError with errors.Is.
var ErrDaemonNotRunning = errors.New("sandboxd is not running")

// NotRunningError says nothing answers on the socket: it is missing, or
// stale (connection refused).
type NotRunningError struct {
	Socket string
	Err    error
}

func (e *NotRunningError) Error() string {
	return fmt.Sprintf("sandboxd is not running (nothing answers on %s): %v", e.Socket, e.Err)
}

func (e *NotRunningError) Unwrap() error { return e.Err }

// Is makes a NotRunningError match ErrDaemonNotRunning and
// errdefs.ErrUnavailable.
func (e *NotRunningError) Is(target error) bool {
	return target == ErrDaemonNotRunning || target == errdefs.ErrUnavailable
}

// APIError is an error answer of the daemon. Call sites branch on its kind
// through errdefs (it is always wrapped in an *errdefs.Error).
type APIError struct {
	Status  int    // HTTP status; 200 for an error frame of a stream
	Code    string // the wire code (an errdefs kind)
	Message string
}

func (e *APIError) Error() string { return e.Message }

// apiError builds the kinded error for an error detail.
func apiError(status int, d ipc.ErrorDetail) error {
	kind := errdefs.Kind(d.Code)
	if !ipc.KnownKind(d.Code) {
		kind = ipc.KindOfStatus(status)
	}
	msg := d.Message
	if msg == "" {
		msg = fmt.Sprintf("sandboxd answered %d %s", status, statusText(status))
	}
	return &errdefs.Error{Kind: kind, Err: &APIError{Status: status, Code: d.Code, Message: msg}}
}

// decodeError turns a non-2xx answer into a kinded error.
func decodeError(resp *response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.body, maxErrorBody))
	var body ipc.ErrorBody
	if err := json.Unmarshal(b, &body); err != nil || body.Error.Code == "" {
		snippet := string(bytes.TrimSpace(b))
		if len(snippet) > 200 {
			snippet = snippet[:200] + "..."
		}
		return apiError(resp.status, ipc.ErrorDetail{Message: fmt.Sprintf("sandboxd answered %d %s: %s", resp.status, statusText(resp.status), snippet)})
	}
	return apiError(resp.status, body.Error)
}

// transportError classifies a failed round trip.
func transportError(ctx context.Context, method, path string, err error) error {
	var nr *NotRunningError
	if errors.As(err, &nr) {
		return nr
	}
	var ue *UntrustedError
	if errors.As(err, &ue) {
		return ue
	}
	var kinded *errdefs.Error
	if errors.As(err, &kinded) {
		return err
	}
	if ctx.Err() != nil {
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return errdefs.Timeout(fmt.Errorf("%s %s: %w", method, path, ctx.Err()))
		}
		return errdefs.Canceled(fmt.Errorf("%s %s: %w", method, path, ctx.Err()))
	}
	if method == methodPost && path == "/v1/exec" {
		// The daemon answers before it runs the command (the started
		// frame): no answer means nothing ran.
		return errdefs.Unavailable(fmt.Errorf("%s %s: the connection to sandboxd failed before it answered (did the daemon stop? `nook daemon status` tells), so the command did not run and it is safe to retry: %w", method, path, err))
	}
	return errdefs.Unavailable(fmt.Errorf("%s %s: the connection to sandboxd failed (did the daemon stop?): %w", method, path, err))
}

// jsonRequest is a request whose body, unless in is nil, is in as JSON.
func jsonRequest(method, path string, q params, in any) (request, error) {
	r := request{method: method, path: path, query: q}
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return r, errdefs.Invalidf("encode the %s %s request: %v", method, path, err)
		}
		r.body, r.contentType = b, "application/json"
	}
	return r, nil
}

// do sends in (JSON, unless nil) and decodes the answer into out.
func (c *Client) do(ctx context.Context, method, path string, q params, in, out any) error {
	r, err := jsonRequest(method, path, q, in)
	if err != nil {
		return err
	}
	resp, cc, err := c.roundTrip(ctx, r)
	if err != nil {
		return err
	}
	defer cc.close()
	if out == nil {
		_, _ = io.Copy(io.Discard, resp.body)
		return nil
	}
	if err := json.NewDecoder(resp.body).Decode(out); err != nil {
		if ctx.Err() != nil {
			return transportError(ctx, method, path, err)
		}
		return errdefs.Internal(fmt.Errorf("decode the answer to %s %s: %w", method, path, err))
	}
	return nil
}

// call is do for a request with a typed JSON answer.
func call[Resp any](ctx context.Context, c *Client, method, path string, q params, in any) (Resp, error) {
	var out Resp
	if err := c.do(ctx, method, path, q, in, &out); err != nil {
		var zero Resp
		return zero, err
	}
	return out, nil
}

// Version is GET /v1/version.
func (c *Client) Version(ctx context.Context) (ipc.VersionResponse, error) {
	return call[ipc.VersionResponse](ctx, c, methodGet, "/v1/version", nil, nil)
}

// Health is GET /v1/health.
func (c *Client) Health(ctx context.Context) (ipc.HealthResponse, error) {
	return call[ipc.HealthResponse](ctx, c, methodGet, "/v1/health", nil, nil)
}

// StopDaemon is POST /v1/daemon/stop: the daemon begins shutting down.
func (c *Client) StopDaemon(ctx context.Context) error {
	return c.do(ctx, methodPost, "/v1/daemon/stop", nil, nil, nil)
}

// OpenAPI is GET /v1/openapi.yaml.
func (c *Client) OpenAPI(ctx context.Context) ([]byte, error) {
	const path = "/v1/openapi.yaml"
	resp, cc, err := c.roundTrip(ctx, request{method: methodGet, path: path})
	if err != nil {
		return nil, err
	}
	defer cc.close()
	b, err := io.ReadAll(resp.body)
	if err != nil {
		return nil, transportError(ctx, methodGet, path, err)
	}
	return b, nil
}

// Config is GET /v1/config.
func (c *Client) Config(ctx context.Context) (ipc.ConfigResponse, error) {
	return call[ipc.ConfigResponse](ctx, c, methodGet, "/v1/config", nil, nil)
}

// Doctor is GET /v1/doctor.
func (c *Client) Doctor(ctx context.Context) (ipc.DoctorResponse, error) {
	return call[ipc.DoctorResponse](ctx, c, methodGet, "/v1/doctor", nil, nil)
}

// Start is POST /v1/sessions/start.
func (c *Client) Start(ctx context.Context, req ipc.StartRequest) (ipc.StartResponse, error) {
	return call[ipc.StartResponse](ctx, c, methodPost, "/v1/sessions/start", nil, req)
}

// Reset is POST /v1/sessions/reset.
func (c *Client) Reset(ctx context.Context, req ipc.StartRequest) (ipc.StartResponse, error) {
	return call[ipc.StartResponse](ctx, c, methodPost, "/v1/sessions/reset", nil, req)
}

// Pull is POST /v1/pull: bring the sandbox's edits back into the
// checkout now.
func (c *Client) Pull(ctx context.Context, req ipc.PullRequest) (ipc.PullResponse, error) {
	return call[ipc.PullResponse](ctx, c, methodPost, "/v1/pull", nil, req)
}

// Push is POST /v1/push: sync the working tree to the sandbox without
// running a command.
func (c *Client) Push(ctx context.Context, req ipc.PushRequest) (ipc.PushResponse, error) {
	return call[ipc.PushResponse](ctx, c, methodPost, "/v1/push", nil, req)
}

// List is GET /v1/sessions.
func (c *Client) List(ctx context.Context, req ipc.ListRequest) (ipc.ListResponse, error) {
	var q params
	if req.All {
		q = params{"all": "true"}
	}
	return call[ipc.ListResponse](ctx, c, methodGet, "/v1/sessions", q, nil)
}

// Stop is POST /v1/sessions/stop.
func (c *Client) Stop(ctx context.Context, req ipc.StopRequest) (ipc.StopResponse, error) {
	return call[ipc.StopResponse](ctx, c, methodPost, "/v1/sessions/stop", nil, req)
}

// Prune is POST /v1/sessions/prune.
func (c *Client) Prune(ctx context.Context, req ipc.PruneRequest) (ipc.PruneResponse, error) {
	return call[ipc.PruneResponse](ctx, c, methodPost, "/v1/sessions/prune", nil, req)
}

// Keep is POST /v1/sessions/keep.
func (c *Client) Keep(ctx context.Context, req ipc.KeepRequest) (ipc.KeepResponse, error) {
	return call[ipc.KeepResponse](ctx, c, methodPost, "/v1/sessions/keep", nil, req)
}

// Init is POST /v1/init.
func (c *Client) Init(ctx context.Context, req ipc.InitRequest) (ipc.InitResponse, error) {
	return call[ipc.InitResponse](ctx, c, methodPost, "/v1/init", nil, req)
}

// Status is GET /v1/status.
func (c *Client) Status(ctx context.Context, req ipc.StatusRequest) (ipc.ProbeResponse, error) {
	return call[ipc.ProbeResponse](ctx, c, methodGet, "/v1/status", targetQuery(req), nil)
}

// targetQuery is a target as query parameters, those given only.
func targetQuery(t ipc.Target) params {
	q := params{}
	for k, v := range map[string]string{"cwd": t.Cwd, "configFile": t.ConfigFile, "runId": t.RunID} {
		if v != "" {
			q[k] = v
		}
	}
	return q
}

// Probe is GET /v1/sessions/{id}/probe.
func (c *Client) Probe(ctx context.Context, sessionID string) (ipc.ProbeResponse, error) {
	return call[ipc.ProbeResponse](ctx, c, methodGet, "/v1/sessions/"+escape(sessionID, false)+"/probe", nil, nil)
}

// Reconcile is POST /v1/reconcile: it returns once the pass is over.
func (c *Client) Reconcile(ctx context.Context) error {
	return c.do(ctx, methodPost, "/v1/reconcile", nil, nil, nil)
}

// sinceQuery is the ?since= parameter.
func sinceQuery(since *uint64) params {
	if since == nil {
		return nil
	}
	return params{"since": strconv.FormatUint(*since, 10)}
}

// Package client is the one typed Go client of sandboxd's socket API, used by
// nook, editor integrations and the tests. Errors come back as errdefs kinds
// (errors.Is(err, errdefs.ErrNotFound)) carrying the daemon's message; a
// daemon that is not running is a *NotRunningError.
//
// It is net/http over a Unix dialer (as tailscale's client/local) with
// encoding/json. Each call has a connection of its own, closed when the
// call ends (keep-alives are off): the daemon is on this machine, so a
// connection costs microseconds, and no pool outlives a call. Cancelling a
// call's context closes its connection, which is how the daemon learns that
// the caller went away (a running exec is then cancelled).
package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
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

// maxHeaderBytes bounds an answer's head: sandboxd's are a few hundred
// bytes, and a peer that sends more must not make the client buffer
// without end.
const maxHeaderBytes = 64 << 10

// baseURL is where requests go; the dialer ignores the host and dials the
// socket.
const baseURL = "http://sandboxd"

// Client talks to one sandboxd socket. It is safe for concurrent use.
type Client struct {
	socket      string
	dialTimeout time.Duration
	userAgent   string
	hc          *http.Client

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
	c.hc = c.httpClient(nil)
	return c
}

// httpClient is an http.Client whose connections are this client's dial;
// onClose, when set, is called once the connection is closed, for whatever
// reason.
func (c *Client) httpClient(onClose func()) *http.Client {
	return &http.Client{
		// sandboxd never redirects: a 3xx is an answer, taken as an error.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				conn, err := c.dial(ctx)
				if err != nil {
					return nil, err
				}
				conn = answerFirstConn{conn}
				if onClose == nil {
					return conn, nil
				}
				return &hookedConn{Conn: conn, onClose: onClose}, nil
			},
			DisableKeepAlives:      true,
			DisableCompression:     true,
			MaxResponseHeaderBytes: maxHeaderBytes,
			// The socket is local: no proxy, whatever the environment says.
			Proxy: nil,
		},
	}
}

// answerFirstConn drops what is written after the daemon closed its end:
// the daemon answers an exec it refuses before reading the stdin being
// uploaded, then closes, and net/http's transport would return the
// upload's broken pipe instead of that answer. The answer, or the end of
// the connection, is still read; a write after Close still fails.
type answerFirstConn struct{ net.Conn }

func (c answerFirstConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET) {
		return len(p), nil
	}
	return n, err
}

// hookedConn calls onClose once the connection is closed.
type hookedConn struct {
	net.Conn
	once    sync.Once
	onClose func()
}

func (h *hookedConn) Close() error {
	err := h.Conn.Close()
	h.once.Do(h.onClose)
	return err
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
// call's connection ends with the call.
func (c *Client) Close() { c.hc.CloseIdleConnections() }

// dial connects to the socket and checks that this user's daemon serves it
// before anything is sent.
func (c *Client) dial(ctx context.Context) (net.Conn, error) {
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

// request is one call's request: a JSON body (when in is not nil) or a
// body of its own.
type request struct {
	method, path string
	query        url.Values
	contentType  string
	body         io.Reader
	// length is the body's length, -1 for a stream (sent chunked).
	length  int64
	header  http.Header
	upgrade string
	// onConnClose, when set, is called once the call's connection closes.
	onConnClose func()
}

// jsonRequest is a request whose body, unless in is nil, is in as JSON.
func jsonRequest(method, path string, q url.Values, in any) (request, error) {
	r := request{method: method, path: path, query: q}
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return r, errdefs.Invalidf("encode the %s %s request: %v", method, path, err)
		}
		r.body, r.length, r.contentType = bytes.NewReader(b), int64(len(b)), "application/json"
	}
	return r, nil
}

// roundTrip sends r and returns its answer, whose body the caller closes.
// An answer other than 2xx (or 101 to an upgrade) is returned as its error.
func (c *Client) roundTrip(ctx context.Context, r request) (*http.Response, error) {
	resp, err := c.send(ctx, r)
	if err != nil {
		return nil, transportError(ctx, r.method, r.path, err)
	}
	if err := c.received(resp, r.upgrade != ""); err != nil {
		resp.Body.Close()
		return nil, err
	}
	return resp, nil
}

// send sends r and returns its answer, or net/http's error as it is.
func (c *Client) send(ctx context.Context, r request) (*http.Response, error) {
	u := baseURL + r.path
	if len(r.query) > 0 {
		u += "?" + r.query.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, r.method, u, r.body)
	if err != nil {
		return nil, errdefs.Invalidf("build the %s %s request: %v", r.method, r.path, err)
	}
	if r.body != nil {
		req.ContentLength = r.length
	}
	for k, v := range r.header {
		req.Header[k] = v
	}
	req.Header.Set("User-Agent", c.userAgent)
	if r.contentType != "" {
		req.Header.Set("Content-Type", r.contentType)
	}
	if r.upgrade != "" {
		req.Header.Set("Connection", "Upgrade")
		req.Header.Set("Upgrade", r.upgrade)
	}
	hc := c.hc
	if r.onConnClose != nil {
		hc = c.httpClient(r.onConnClose)
	}
	return hc.Do(req)
}

// connectFailed reports whether err is the dialer's: nothing was sent.
func connectFailed(err error) bool {
	var nr *NotRunningError
	var ue *UntrustedError
	var kinded *errdefs.Error
	return errors.As(err, &nr) || errors.As(err, &ue) || errors.As(err, &kinded)
}

// unwrapURL drops net/http's *url.Error, which repeats the method and a
// URL naming no socket.
func unwrapURL(err error) error {
	var uerr *url.Error
	if errors.As(err, &uerr) {
		return uerr.Err
	}
	return err
}

// received records what every answer's head tells and returns the error
// of an answer that is not a success.
func (c *Client) received(resp *http.Response, upgrade bool) error {
	if v := resp.Header.Get(ipc.HeaderVersion); v != "" {
		c.daemonVersion.Store(&v)
	}
	if v := resp.Header.Get(ipc.HeaderWarning); v != "" {
		c.warning.Store(&v)
	}
	switch {
	case resp.StatusCode == http.StatusSwitchingProtocols && upgrade, resp.StatusCode/100 == 2:
		return nil
	case resp.StatusCode == http.StatusSwitchingProtocols:
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
		msg = fmt.Sprintf("sandboxd answered %d %s", status, http.StatusText(status))
	}
	return &errdefs.Error{Kind: kind, Err: &APIError{Status: status, Code: d.Code, Message: msg}}
}

// decodeError turns a non-2xx answer into a kinded error.
func decodeError(resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	var body ipc.ErrorBody
	if err := json.Unmarshal(b, &body); err != nil || body.Error.Code == "" {
		snippet := string(bytes.TrimSpace(b))
		if len(snippet) > 200 {
			snippet = snippet[:200] + "..."
		}
		return apiError(resp.StatusCode, ipc.ErrorDetail{Message: fmt.Sprintf("sandboxd answered %d %s: %s", resp.StatusCode, http.StatusText(resp.StatusCode), snippet)})
	}
	return apiError(resp.StatusCode, body.Error)
}

// transportError classifies a failed round trip.
func transportError(ctx context.Context, method, path string, err error) error {
	err = unwrapURL(err)
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
	if method == http.MethodPost && path == "/v1/exec" {
		// The daemon answers before it runs the command (the started
		// frame): no answer means nothing ran.
		return errdefs.Unavailable(fmt.Errorf("%s %s: the connection to sandboxd failed before it answered (did the daemon stop? `nook daemon status` tells), so the command did not run and it is safe to retry: %w", method, path, err))
	}
	return errdefs.Unavailable(fmt.Errorf("%s %s: the connection to sandboxd failed (did the daemon stop?): %w", method, path, err))
}

// do sends in (JSON, unless nil) and decodes the answer into out.
func (c *Client) do(ctx context.Context, method, path string, q url.Values, in, out any) error {
	r, err := jsonRequest(method, path, q, in)
	if err != nil {
		return err
	}
	resp, err := c.roundTrip(ctx, r)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		if ctx.Err() != nil {
			return transportError(ctx, method, path, err)
		}
		return errdefs.Internal(fmt.Errorf("decode the answer to %s %s: %w", method, path, err))
	}
	return nil
}

// call is do for a request with a typed JSON answer.
func call[Resp any](ctx context.Context, c *Client, method, path string, q url.Values, in any) (Resp, error) {
	var out Resp
	if err := c.do(ctx, method, path, q, in, &out); err != nil {
		var zero Resp
		return zero, err
	}
	return out, nil
}

// Version is GET /v1/version.
func (c *Client) Version(ctx context.Context) (ipc.VersionResponse, error) {
	return call[ipc.VersionResponse](ctx, c, http.MethodGet, "/v1/version", nil, nil)
}

// Health is GET /v1/health.
func (c *Client) Health(ctx context.Context) (ipc.HealthResponse, error) {
	return call[ipc.HealthResponse](ctx, c, http.MethodGet, "/v1/health", nil, nil)
}

// StopDaemon is POST /v1/daemon/stop: the daemon begins shutting down.
func (c *Client) StopDaemon(ctx context.Context) error {
	return c.do(ctx, http.MethodPost, "/v1/daemon/stop", nil, nil, nil)
}

// OpenAPI is GET /v1/openapi.yaml.
func (c *Client) OpenAPI(ctx context.Context) ([]byte, error) {
	const path = "/v1/openapi.yaml"
	resp, err := c.roundTrip(ctx, request{method: http.MethodGet, path: path})
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, transportError(ctx, http.MethodGet, path, err)
	}
	return b, nil
}

// Config is GET /v1/config.
func (c *Client) Config(ctx context.Context) (ipc.ConfigResponse, error) {
	return call[ipc.ConfigResponse](ctx, c, http.MethodGet, "/v1/config", nil, nil)
}

// Doctor is GET /v1/doctor.
func (c *Client) Doctor(ctx context.Context) (ipc.DoctorResponse, error) {
	return call[ipc.DoctorResponse](ctx, c, http.MethodGet, "/v1/doctor", nil, nil)
}

// Start is POST /v1/sessions/start.
func (c *Client) Start(ctx context.Context, req ipc.StartRequest) (ipc.StartResponse, error) {
	return call[ipc.StartResponse](ctx, c, http.MethodPost, "/v1/sessions/start", nil, req)
}

// Reset is POST /v1/sessions/reset.
func (c *Client) Reset(ctx context.Context, req ipc.StartRequest) (ipc.StartResponse, error) {
	return call[ipc.StartResponse](ctx, c, http.MethodPost, "/v1/sessions/reset", nil, req)
}

// Pull is POST /v1/pull: bring the sandbox's edits back into the
// checkout now.
func (c *Client) Pull(ctx context.Context, req ipc.PullRequest) (ipc.PullResponse, error) {
	return call[ipc.PullResponse](ctx, c, http.MethodPost, "/v1/pull", nil, req)
}

// Push is POST /v1/push: sync the working tree to the sandbox without
// running a command.
func (c *Client) Push(ctx context.Context, req ipc.PushRequest) (ipc.PushResponse, error) {
	return call[ipc.PushResponse](ctx, c, http.MethodPost, "/v1/push", nil, req)
}

// List is GET /v1/sessions.
func (c *Client) List(ctx context.Context, req ipc.ListRequest) (ipc.ListResponse, error) {
	var q url.Values
	if req.All {
		q = url.Values{"all": {"true"}}
	}
	return call[ipc.ListResponse](ctx, c, http.MethodGet, "/v1/sessions", q, nil)
}

// Stop is POST /v1/sessions/stop.
func (c *Client) Stop(ctx context.Context, req ipc.StopRequest) (ipc.StopResponse, error) {
	return call[ipc.StopResponse](ctx, c, http.MethodPost, "/v1/sessions/stop", nil, req)
}

// Prune is POST /v1/sessions/prune.
func (c *Client) Prune(ctx context.Context, req ipc.PruneRequest) (ipc.PruneResponse, error) {
	return call[ipc.PruneResponse](ctx, c, http.MethodPost, "/v1/sessions/prune", nil, req)
}

// Keep is POST /v1/sessions/keep.
func (c *Client) Keep(ctx context.Context, req ipc.KeepRequest) (ipc.KeepResponse, error) {
	return call[ipc.KeepResponse](ctx, c, http.MethodPost, "/v1/sessions/keep", nil, req)
}

// Init is POST /v1/init.
func (c *Client) Init(ctx context.Context, req ipc.InitRequest) (ipc.InitResponse, error) {
	return call[ipc.InitResponse](ctx, c, http.MethodPost, "/v1/init", nil, req)
}

// Status is GET /v1/status.
func (c *Client) Status(ctx context.Context, req ipc.StatusRequest) (ipc.ProbeResponse, error) {
	return call[ipc.ProbeResponse](ctx, c, http.MethodGet, "/v1/status", targetQuery(req), nil)
}

// targetQuery is a target as query parameters, those given only.
func targetQuery(t ipc.Target) url.Values {
	q := url.Values{}
	for k, v := range map[string]string{"cwd": t.Cwd, "configFile": t.ConfigFile, "runId": t.RunID} {
		if v != "" {
			q.Set(k, v)
		}
	}
	return q
}

// Probe is GET /v1/sessions/{id}/probe.
func (c *Client) Probe(ctx context.Context, sessionID string) (ipc.ProbeResponse, error) {
	return call[ipc.ProbeResponse](ctx, c, http.MethodGet, "/v1/sessions/"+url.PathEscape(sessionID)+"/probe", nil, nil)
}

// Reconcile is POST /v1/reconcile: it returns once the pass is over.
func (c *Client) Reconcile(ctx context.Context) error {
	return c.do(ctx, http.MethodPost, "/v1/reconcile", nil, nil, nil)
}

// sinceQuery is the ?since= parameter.
func sinceQuery(since *uint64) url.Values {
	if since == nil {
		return nil
	}
	return url.Values{"since": {strconv.FormatUint(*since, 10)}}
}

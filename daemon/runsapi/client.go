// Package runsapi is the typed client sandboxd uses to call the RWX runs API
// (the wire contract itself is package rwxapi).
package runsapi

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/sandboxd/sandboxd/rwxapi"
)

// Defaults of Options.
const (
	DefaultTimeout    = 30 * time.Second
	DefaultMaxRetries = 3
	DefaultBackoff    = 250 * time.Millisecond
	DefaultMaxBackoff = 5 * time.Second
	DefaultUserAgent  = "sandboxd"
	// A connection that has said nothing for DefaultPingAfter is pinged;
	// one that does not answer within DefaultPingTimeout is closed, so a
	// call on a connection that went silent (sleep, a new network) fails
	// over instead of waiting out Timeout.
	DefaultPingAfter   = 10 * time.Second
	DefaultPingTimeout = 5 * time.Second
)

// maxErrorBody bounds how much of an error answer is read.
const maxErrorBody = 64 << 10

// Options configure a Client.
type Options struct {
	// BaseURL is the remote's root, e.g. https://cloud.rwx.com. Plain http
	// is refused except to a loopback address (the token travels with every
	// request).
	BaseURL string
	// Token is the account (or access) token sent as a bearer token.
	Token string
	// RootCAs, when set, is the only set of CAs trusted (pins the local
	// remote's self-signed certificate). Not allowed with HTTPClient.
	RootCAs *x509.CertPool
	// HTTPClient replaces the client built from RootCAs (optional). Its own
	// Timeout, if any, also applies.
	HTTPClient *http.Client
	// Timeout bounds each request, body included (default 30s).
	Timeout time.Duration
	// PingAfter and PingTimeout are the health check of the kept HTTP/2
	// connections (defaults DefaultPingAfter, DefaultPingTimeout). They
	// apply to the client built from RootCAs, not to HTTPClient.
	PingAfter, PingTimeout time.Duration
	// MaxRetries is how many times an idempotent GET is sent again after a
	// transient failure (5xx, 429, timeout, connection error): 0 means
	// DefaultMaxRetries, a negative value disables retries. POSTs are never
	// sent twice by the client.
	MaxRetries int
	// Backoff is the wait before the first retry, doubling up to MaxBackoff.
	Backoff, MaxBackoff time.Duration
	// Sleep waits d or until ctx ends (injectable for tests).
	Sleep func(ctx context.Context, d time.Duration) error
	// Now is the clock used to measure calls for the logs (default time.Now).
	Now       func() time.Time
	Logger    *slog.Logger
	UserAgent string
}

// Client is a typed client of the runs API, safe for concurrent use. It
// keeps its HTTPS connections open between calls.
type Client struct {
	base    *url.URL
	token   string
	http    *http.Client
	opts    Options
	retries int
	log     *slog.Logger
}

// New validates opts and returns a client.
func New(opts Options) (*Client, error) {
	base, err := url.Parse(strings.TrimRight(opts.BaseURL, "/"))
	if err != nil || base.Host == "" {
		return nil, fmt.Errorf("runs API base URL %q is not a URL like https://host[:port]: %v", opts.BaseURL, err)
	}
	switch base.Scheme {
	case "https":
	case "http":
		if !isLoopback(base.Hostname()) {
			return nil, fmt.Errorf("runs API base URL %q uses plain http to a non-local host; the access token would travel unencrypted: use https", opts.BaseURL)
		}
	default:
		return nil, fmt.Errorf("runs API base URL %q: scheme must be https", opts.BaseURL)
	}
	if opts.Token == "" {
		return nil, errors.New("runs API: no access token configured")
	}
	if opts.HTTPClient != nil && opts.RootCAs != nil {
		return nil, errors.New("runs API: set RootCAs or HTTPClient, not both")
	}
	if opts.Timeout <= 0 {
		opts.Timeout = DefaultTimeout
	}
	if opts.PingAfter <= 0 {
		opts.PingAfter = DefaultPingAfter
	}
	if opts.PingTimeout <= 0 {
		opts.PingTimeout = DefaultPingTimeout
	}
	if opts.Backoff <= 0 {
		opts.Backoff = DefaultBackoff
	}
	if opts.MaxBackoff <= 0 {
		opts.MaxBackoff = DefaultMaxBackoff
	}
	if opts.Sleep == nil {
		opts.Sleep = sleep
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.UserAgent == "" {
		opts.UserAgent = DefaultUserAgent
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	retries := opts.MaxRetries
	switch {
	case retries == 0:
		retries = DefaultMaxRetries
	case retries < 0:
		retries = 0
	}
	hc := opts.HTTPClient
	if hc == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.TLSClientConfig = &tls.Config{RootCAs: opts.RootCAs, MinVersion: tls.VersionTLS12}
		tr.MaxIdleConnsPerHost = 8
		// A silent connection does not close: only a ping finds it out.
		// The GET that waited on it is then retried on a new one.
		tr.HTTP2 = &http.HTTP2Config{SendPingTimeout: opts.PingAfter, PingTimeout: opts.PingTimeout}
		hc = &http.Client{
			Transport: tr,
			// The API answers directly; a redirect would resend the bearer
			// token somewhere else.
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		}
	}
	return &Client{base: base, token: opts.Token, http: hc, opts: opts, retries: retries, log: log}, nil
}

// CreateRun starts a run. idempotencyKey is sent as Idempotency-Key so that a
// caller retrying after a timeout gets the same run back; the client itself
// never sends this request twice.
func (c *Client) CreateRun(ctx context.Context, def rwxapi.RunDefinition, idempotencyKey string) (rwxapi.CreateRunResult, error) {
	var res rwxapi.CreateRunResult
	err := c.do(ctx, call{
		op: "create run", method: http.MethodPost, path: rwxapi.PathRuns,
		body: rwxapi.CreateRunRequest{Run: def}, idempotencyKey: idempotencyKey,
	}, &res)
	if err == nil && res.RunID == "" {
		err = &APIError{Op: "create run", Message: "the answer has no run_id"}
	}
	return res, err
}

// ConnectionInfo asks how to reach run runID's sandbox. token is a token
// scoped to the run; "" uses the client's own token.
func (c *Client) ConnectionInfo(ctx context.Context, runID, token string) (rwxapi.ConnectionInfo, error) {
	var res rwxapi.ConnectionInfo
	if runID == "" {
		return res, &APIError{Op: "connection info", Status: http.StatusBadRequest, Message: "no run id given"}
	}
	err := c.do(ctx, call{
		op: "connection info", method: http.MethodGet, path: rwxapi.PathConnectionInfo,
		query: url.Values{"sandbox_key": {runID}}, token: token,
	}, &res)
	return res, err
}

// CreateSandboxToken asks for a token scoped to runID, valid for expiresIn
// (0 lets the remote choose).
func (c *Client) CreateSandboxToken(ctx context.Context, runID string, expiresIn time.Duration) (rwxapi.SandboxToken, error) {
	var res rwxapi.SandboxToken
	err := c.do(ctx, call{
		op: "create sandbox token", method: http.MethodPost, path: rwxapi.PathSandboxTokens,
		body: rwxapi.SandboxTokenRequest{RunID: runID, ExpiresInSeconds: int64(expiresIn / time.Second)},
	}, &res)
	if err == nil && res.Token == "" {
		err = &APIError{Op: "create sandbox token", Message: "the answer has no token"}
	}
	return res, err
}

// ListSandboxes lists the caller's runs that are sandboxes in progress.
func (c *Client) ListSandboxes(ctx context.Context) ([]rwxapi.RunSummary, error) {
	var res rwxapi.ListRunsResult
	err := c.do(ctx, call{
		op: "list sandboxes", method: http.MethodGet, path: rwxapi.PathRuns,
		query: url.Values{
			rwxapi.QueryResultStatus:    {rwxapi.ResultStatusSandboxed},
			rwxapi.QueryExecutionStatus: {rwxapi.ExecutionStatusInProgress},
			rwxapi.QueryMyRuns:          {"true"},
		},
	}, &res)
	return res.Runs, err
}

// ListRunsInProgress lists the caller's runs in progress, sandboxable or
// still provisioning (the list of sandboxes shows only the former).
func (c *Client) ListRunsInProgress(ctx context.Context) ([]rwxapi.RunSummary, error) {
	var res rwxapi.ListRunsResult
	err := c.do(ctx, call{
		op: "list runs in progress", method: http.MethodGet, path: rwxapi.PathRuns,
		query: url.Values{
			rwxapi.QueryExecutionStatus: {rwxapi.ExecutionStatusInProgress},
			rwxapi.QueryMyRuns:          {"true"},
		},
	}, &res)
	return res.Runs, err
}

// CancelRun cancels run runID.
func (c *Client) CancelRun(ctx context.Context, runID string) error {
	if runID == "" {
		return &APIError{Op: "cancel run", Status: http.StatusBadRequest, Message: "no run id given"}
	}
	return c.do(ctx, call{op: "cancel run", method: http.MethodPost, path: rwxapi.CancelPath(runID)}, nil)
}

// InitTemplate returns the remote's template for a new .rwx/sandbox.yml.
func (c *Client) InitTemplate(ctx context.Context) (string, error) {
	var res rwxapi.InitTemplateResult
	err := c.do(ctx, call{op: "init template", method: http.MethodGet, path: rwxapi.PathInitTemplate}, &res)
	return res.Template, err
}

// call is one request of the contract.
type call struct {
	op, method, path string
	query            url.Values
	body             any
	token            string // overrides the client token when set
	idempotencyKey   string
	accept           string // default application/json
}

// do sends cl, retrying GETs on transient failures, and decodes a 2xx JSON
// answer into out (nil: the body is ignored).
func (c *Client) do(ctx context.Context, cl call, out any) error {
	var body []byte
	if cl.body != nil {
		b, err := json.Marshal(cl.body)
		if err != nil {
			return &APIError{Op: cl.op, Status: 0, Message: "encode the request", Err: err}
		}
		body = b
	}
	attempts := 1
	if cl.method == http.MethodGet {
		attempts += c.retries
	}
	delay := c.opts.Backoff
	for attempt := 1; ; attempt++ {
		err := c.once(ctx, cl, body, out)
		var apiErr *APIError
		if err == nil || attempt >= attempts || !errors.As(err, &apiErr) || !apiErr.retryable() {
			return err
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%w (gave up retrying: %w)", err, ctx.Err())
		}
		c.log.Debug("runs API call failed, retrying", "op", cl.op, "attempt", attempt, "status", apiErr.Status, "backoff", delay)
		if serr := c.opts.Sleep(ctx, delay); serr != nil {
			return fmt.Errorf("%w (gave up retrying: %w)", err, serr)
		}
		delay = min(delay*2, c.opts.MaxBackoff)
	}
}

// once sends one request.
func (c *Client) once(ctx context.Context, cl call, body []byte, out any) error {
	rctx, cancel := context.WithTimeout(ctx, c.opts.Timeout)
	defer cancel()
	u := *c.base
	u.Path = c.base.Path + cl.path // unescaped; String() escapes it
	u.RawPath = ""
	u.RawQuery = cl.query.Encode()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(rctx, cl.method, u.String(), rd)
	if err != nil {
		return &APIError{Op: cl.op, Message: "build the request", Err: err}
	}
	token := c.token
	if cl.token != "" {
		token = cl.token
	}
	req.Header.Set("Authorization", "Bearer "+token)
	if cl.accept != "" {
		req.Header.Set("Accept", cl.accept)
	} else {
		req.Header.Set("Accept", "application/json")
	}
	req.Header.Set("User-Agent", c.opts.UserAgent)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if cl.idempotencyKey != "" {
		req.Header.Set(rwxapi.HeaderIdempotencyKey, cl.idempotencyKey)
	}

	start := c.opts.Now()
	resp, err := c.http.Do(req)
	if err != nil {
		return c.transportError(ctx, rctx, cl.op, err)
	}
	defer func() {
		// Drain so the connection is reused for the next call.
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxErrorBody))
		resp.Body.Close()
	}()
	c.log.Debug("runs API call", "op", cl.op, "method", cl.method, "path", cl.path, "status", resp.StatusCode, "duration", c.opts.Now().Sub(start))

	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return &APIError{Op: cl.op, Status: resp.StatusCode, Message: errorMessage(resp.Body)}
	}
	if out == nil {
		return nil
	}
	if text, ok := out.(*textAnswer); ok {
		b, err := io.ReadAll(io.LimitReader(resp.Body, text.max))
		if err != nil {
			return c.transportError(ctx, rctx, cl.op, err)
		}
		text.body = b
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		if rctx.Err() != nil {
			return c.transportError(ctx, rctx, cl.op, err)
		}
		return &APIError{Op: cl.op, Message: fmt.Sprintf("the remote answered %d with a body that is not the expected JSON", resp.StatusCode), Err: err}
	}
	return nil
}

// transportError classifies a failure without an HTTP answer: the caller's
// own cancellation stays a context error; a timeout or connection error is
// an unavailable remote.
func (c *Client) transportError(ctx, rctx context.Context, op string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("runs API: %s: %w", op, ctx.Err())
	}
	if errors.Is(rctx.Err(), context.DeadlineExceeded) {
		return &APIError{Op: op, Message: fmt.Sprintf("no answer within %s; the remote may be down or slow, retry later", c.opts.Timeout), Err: context.DeadlineExceeded}
	}
	var uerr *url.Error
	if errors.As(err, &uerr) {
		err = uerr.Err // the URL is in the message already through op
	}
	var operr *net.OpError
	if errors.As(err, &operr) && operr.Err != nil {
		err = operr.Err // its address is the host the message names
	}
	return &APIError{Op: op, Message: "cannot reach " + c.base.Host, Err: err}
}

// errorMessage extracts the remote's message from an error body:
// {"error":"..."} (the contract), {"error":{"message":"..."}} or
// {"message":"..."}; else the start of the body.
func errorMessage(r io.Reader) string {
	raw, _ := io.ReadAll(io.LimitReader(r, maxErrorBody))
	var body struct {
		Error   json.RawMessage `json:"error"`
		Message string          `json:"message"`
	}
	if json.Unmarshal(raw, &body) == nil {
		var s string
		if json.Unmarshal(body.Error, &s) == nil && s != "" {
			return s
		}
		var nested struct {
			Message string `json:"message"`
		}
		if json.Unmarshal(body.Error, &nested) == nil && nested.Message != "" {
			return nested.Message
		}
		if body.Message != "" {
			return body.Message
		}
	}
	msg := strings.TrimSpace(string(raw))
	if len(msg) > 200 {
		msg = msg[:200] + "..."
	}
	return msg
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// CloseIdleConnections closes the kept-alive connections not in use: after
// a sleep or a change of network they may be silent, and a call sent on
// one would wait for its whole timeout.
func (c *Client) CloseIdleConnections() { c.http.CloseIdleConnections() }

package runsapi

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/json"
	"errors"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/rwxapi"

	"github.com/sandboxd/sandboxd/errdefs"
)

const testToken = "tok-secret-123"

// fakeRemote is an httptest TLS server that records what it received.
type fakeRemote struct {
	srv     *httptest.Server
	mu      sync.Mutex
	reqs    []recorded
	handler http.HandlerFunc
}

type recorded struct {
	method, path, query, auth, idem, contentType string
	body                                         []byte
}

func newFakeRemote(t *testing.T, h http.HandlerFunc) *fakeRemote {
	t.Helper()
	f := &fakeRemote{handler: h}
	f.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.reqs = append(f.reqs, recorded{r.Method, r.URL.Path, r.URL.RawQuery, r.Header.Get("Authorization"), r.Header.Get(rwxapi.HeaderIdempotencyKey), r.Header.Get("Content-Type"), b})
		f.mu.Unlock()
		r.Body = io.NopCloser(bytes.NewReader(b))
		f.handler(w, r)
	}))
	f.srv.Config.ErrorLog = log.New(io.Discard, "", 0) // refused handshakes are expected in some tests
	f.srv.StartTLS()
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeRemote) requests() []recorded {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]recorded(nil), f.reqs...)
}

// client pins the test server's certificate through RootCAs, as sandboxd
// pins localcloud's.
func (f *fakeRemote) client(t *testing.T, mod func(*Options)) *Client {
	t.Helper()
	pool := x509.NewCertPool()
	pool.AddCert(f.srv.Certificate())
	opts := Options{
		BaseURL: f.srv.URL, Token: testToken, RootCAs: pool,
		Backoff: time.Millisecond, MaxBackoff: 4 * time.Millisecond,
	}
	if mod != nil {
		mod(&opts)
	}
	c, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func TestCreateRunSendsBodyAndIdempotencyKey(t *testing.T) {
	f := newFakeRemote(t, func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusCreated, map[string]string{"run_id": "run-1", "run_url": "https://x/runs/run-1"})
	})
	c := f.client(t, nil)
	def := rwxapi.RunDefinition{
		Title:           "sandbox",
		CLIState:        rwxapi.CLIState{Branch: "main", ConfigFile: ".rwx/sandbox.yml"}.Encode(),
		Git:             rwxapi.GitMetadata{Branch: "main", Sha: "abc", OriginURL: "git@x:y.git"},
		TaskDefinitions: []rwxapi.DirectoryEntry{{Path: ".rwx/sandbox.yml", Type: "file", Permissions: 0o644, FileContents: "tasks: []"}},
		MintDirectory:   []rwxapi.DirectoryEntry{{Path: ".rwx", Type: "dir", Permissions: 0o755}},
	}
	res, err := c.CreateRun(context.Background(), def, "idem-42")
	if err != nil {
		t.Fatal(err)
	}
	if res.RunID != "run-1" || res.RunURL != "https://x/runs/run-1" {
		t.Fatalf("result %+v", res)
	}
	reqs := f.requests()
	if len(reqs) != 1 {
		t.Fatalf("%d requests, want 1", len(reqs))
	}
	r := reqs[0]
	if r.method != http.MethodPost || r.path != rwxapi.PathRuns {
		t.Errorf("request %s %s", r.method, r.path)
	}
	if r.idem != "idem-42" {
		t.Errorf("Idempotency-Key = %q", r.idem)
	}
	if r.auth != "Bearer "+testToken {
		t.Errorf("Authorization = %q", r.auth)
	}
	if r.contentType != "application/json" {
		t.Errorf("Content-Type = %q", r.contentType)
	}
	var got map[string]map[string]any
	if err := json.Unmarshal(r.body, &got); err != nil {
		t.Fatalf("body %s: %v", r.body, err)
	}
	run := got["run"]
	for _, k := range []string{"title", "cli_state", "git", "task_definitions", "mint_directory", "use_cache"} {
		if _, ok := run[k]; !ok {
			t.Errorf("body lacks run.%s: %s", k, r.body)
		}
	}
	if g := run["git"].(map[string]any); g["branch"] != "main" || g["sha"] != "abc" || g["origin_url"] != "git@x:y.git" {
		t.Errorf("git = %v", g)
	}
}

func TestPostIsNeverResent(t *testing.T) {
	for _, status := range []int{http.StatusServiceUnavailable, http.StatusBadGateway, http.StatusInternalServerError} {
		var n atomic.Int32
		f := newFakeRemote(t, func(w http.ResponseWriter, r *http.Request) {
			n.Add(1)
			writeJSON(w, status, rwxapi.ErrorBody{Error: "busy"})
		})
		c := f.client(t, nil)
		_, err := c.CreateRun(context.Background(), rwxapi.RunDefinition{}, "k")
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("%d: err = %v, want unavailable", status, err)
		}
		if err := c.CancelRun(context.Background(), "r"); !errors.Is(err, ErrUnavailable) {
			t.Fatalf("cancel: %v", err)
		}
		if _, err := c.CreateSandboxToken(context.Background(), "r", time.Hour); !errors.Is(err, ErrUnavailable) {
			t.Fatalf("token: %v", err)
		}
		if got := n.Load(); got != 3 {
			t.Fatalf("%d: server saw %d requests for 3 POSTs", status, got)
		}
	}
}

func TestGetRetriedOnTransientFailureWithBackoff(t *testing.T) {
	var n atomic.Int32
	f := newFakeRemote(t, func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) <= 2 {
			writeJSON(w, http.StatusServiceUnavailable, rwxapi.ErrorBody{Error: "warming up"})
			return
		}
		writeJSON(w, http.StatusOK, rwxapi.InitTemplateResult{Template: "tasks: []\n"})
	})
	var sleeps []time.Duration
	c := f.client(t, func(o *Options) {
		o.Backoff, o.MaxBackoff = 10*time.Millisecond, 15*time.Millisecond
		o.Sleep = func(ctx context.Context, d time.Duration) error { sleeps = append(sleeps, d); return nil }
	})
	tpl, err := c.InitTemplate(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if tpl != "tasks: []\n" {
		t.Errorf("template %q", tpl)
	}
	if n.Load() != 3 {
		t.Errorf("server saw %d requests, want 3", n.Load())
	}
	if len(sleeps) != 2 || sleeps[0] != 10*time.Millisecond || sleeps[1] != 15*time.Millisecond {
		t.Errorf("backoffs %v, want [10ms 15ms] (doubling, capped)", sleeps)
	}
}

func TestGetGivesUpAfterMaxRetries(t *testing.T) {
	var n atomic.Int32
	f := newFakeRemote(t, func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		w.WriteHeader(http.StatusBadGateway)
	})
	c := f.client(t, func(o *Options) { o.MaxRetries = 2 })
	_, err := c.ListSandboxes(context.Background())
	var apiErr *APIError
	if !errors.As(err, &apiErr) || apiErr.Status != http.StatusBadGateway || !errors.Is(err, ErrUnavailable) {
		t.Fatalf("err = %v", err)
	}
	if n.Load() != 3 {
		t.Fatalf("server saw %d requests, want 1 + 2 retries", n.Load())
	}
}

func TestDefiniteAnswersAreNotRetried(t *testing.T) {
	var n atomic.Int32
	f := newFakeRemote(t, func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		writeJSON(w, http.StatusGone, rwxapi.ErrorBody{Error: "run finished"})
	})
	c := f.client(t, nil)
	if _, err := c.ConnectionInfo(context.Background(), "r", ""); !errors.Is(err, ErrGone) {
		t.Fatalf("err = %v", err)
	}
	if n.Load() != 1 {
		t.Fatalf("a 410 was sent %d times", n.Load())
	}
}

func TestBackoffHonorsContext(t *testing.T) {
	f := newFakeRemote(t, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	})
	c := f.client(t, func(o *Options) { o.Backoff, o.MaxBackoff = time.Hour, time.Hour }) // the real Sleep
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		for len(f.requests()) == 0 {
			time.Sleep(time.Millisecond)
		}
		cancel()
	}()
	done := make(chan error, 1)
	go func() { _, err := c.ListSandboxes(ctx); done <- err }()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("err = %v, want context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("backoff ignored the cancelled context")
	}
}

func TestTimeoutIsUnavailable(t *testing.T) {
	release := make(chan struct{})
	f := newFakeRemote(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	defer close(release)
	c := f.client(t, func(o *Options) { o.Timeout = 50 * time.Millisecond; o.MaxRetries = -1 })
	_, err := c.ConnectionInfo(context.Background(), "r", "")
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("err = %v, want unavailable", err)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("err = %v should wrap DeadlineExceeded", err)
	}
	if errors.Is(err, ErrNotFound) || errors.Is(err, ErrGone) {
		t.Errorf("a timeout must not look like a definite answer: %v", err)
	}
}

func TestConnectionErrorIsUnavailable(t *testing.T) {
	f := newFakeRemote(t, func(w http.ResponseWriter, r *http.Request) {})
	c := f.client(t, func(o *Options) { o.MaxRetries = -1 })
	f.srv.Close()
	_, err := c.ListSandboxes(context.Background())
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("err = %v, want unavailable", err)
	}
}

func TestErrorKindsKeepTheirKind(t *testing.T) {
	cases := []struct {
		status int
		body   string
		want   error
		msg    string
	}{
		{404, `{"error":"no such run"}`, ErrNotFound, "no such run"},
		{410, `{"error":"the run has finished"}`, ErrGone, "the run has finished"},
		{401, `{"error":"bad token"}`, ErrUnauthorized, "bad token"},
		{403, `{"error":{"message":"forbidden here"}}`, ErrUnauthorized, "forbidden here"},
		{400, `{"error":"sandbox_key missing"}`, ErrInvalid, "sandbox_key missing"},
		{422, `{"message":"bad config"}`, ErrInvalid, "bad config"},
		{500, `oops`, ErrUnavailable, "oops"},
		{503, ``, ErrUnavailable, ""},
	}
	for _, tc := range cases {
		f := newFakeRemote(t, func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(tc.status)
			_, _ = io.WriteString(w, tc.body)
		})
		c := f.client(t, func(o *Options) { o.Sleep = func(context.Context, time.Duration) error { return nil } })
		_, err := c.ConnectionInfo(context.Background(), "run-9", "")
		if !errors.Is(err, tc.want) {
			t.Errorf("%d: err = %v, want kind %v", tc.status, err, tc.want)
		}
		var apiErr *APIError
		if !errors.As(err, &apiErr) || apiErr.Status != tc.status || apiErr.Message != tc.msg || apiErr.Op != "connection info" {
			t.Errorf("%d: APIError = %+v", tc.status, apiErr)
		}
		// The daemon maps kinds without translation.
		if errdefs.KindOf(err) != tc.want.(*errdefs.Error).Kind {
			t.Errorf("%d: errdefs.KindOf = %s", tc.status, errdefs.KindOf(err))
		}
	}
}

func TestConnectionInfoTokens(t *testing.T) {
	f := newFakeRemote(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("sandbox_key") != "run 7" {
			writeJSON(w, 400, rwxapi.ErrorBody{Error: "sandbox_key"})
			return
		}
		writeJSON(w, 200, rwxapi.ConnectionInfo{Sandboxable: true, Address: "127.0.0.1:2222", PublicHostKey: "ssh-ed25519 AAAA", PrivateUserKey: "PEM", Polling: rwxapi.Polling{Completed: false, BackoffMs: 500}})
	})
	c := f.client(t, nil)
	ci, err := c.ConnectionInfo(context.Background(), "run 7", "")
	if err != nil {
		t.Fatal(err)
	}
	if !ci.Sandboxable || ci.Address != "127.0.0.1:2222" || ci.Polling.BackoffMs != 500 {
		t.Errorf("info %+v", ci)
	}
	if _, err := c.ConnectionInfo(context.Background(), "run 7", "scoped-1"); err != nil {
		t.Fatal(err)
	}
	reqs := f.requests()
	if reqs[0].auth != "Bearer "+testToken || reqs[1].auth != "Bearer scoped-1" {
		t.Errorf("auth headers %q, %q", reqs[0].auth, reqs[1].auth)
	}
	if reqs[0].method != http.MethodGet || reqs[0].path != rwxapi.PathConnectionInfo {
		t.Errorf("request %s %s", reqs[0].method, reqs[0].path)
	}
}

func TestListTokenCancelTemplateShapes(t *testing.T) {
	f := newFakeRemote(t, func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodGet && r.URL.Path == rwxapi.PathRuns:
			writeJSON(w, 200, rwxapi.ListRunsResult{Runs: []rwxapi.RunSummary{{ID: "a", RunURL: "u", Title: "t", CLIState: "cs"}}})
		case r.Method == http.MethodPost && r.URL.Path == rwxapi.PathSandboxTokens:
			writeJSON(w, 201, rwxapi.SandboxToken{Token: "scoped", ExpiresAt: "2030-01-01T00:00:00Z", RunID: "a"})
		case r.Method == http.MethodPost && r.URL.Path == rwxapi.CancelPath("a"):
			w.WriteHeader(200)
		default:
			writeJSON(w, 404, rwxapi.ErrorBody{Error: "no route"})
		}
	})
	c := f.client(t, nil)
	ctx := context.Background()
	runs, err := c.ListSandboxes(ctx)
	if err != nil || len(runs) != 1 || runs[0] != (rwxapi.RunSummary{ID: "a", RunURL: "u", Title: "t", CLIState: "cs"}) {
		t.Fatalf("list = %+v, %v", runs, err)
	}
	tok, err := c.CreateSandboxToken(ctx, "a", 90*time.Minute)
	if err != nil || tok.Token != "scoped" || tok.RunID != "a" {
		t.Fatalf("token = %+v, %v", tok, err)
	}
	if err := c.CancelRun(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if err := c.CancelRun(ctx, "missing"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("cancel of an unknown run: %v", err)
	}
	reqs := f.requests()
	if q := reqs[0].query; !strings.Contains(q, "result_status=sandboxed") || !strings.Contains(q, "execution_status=in_progress") || !strings.Contains(q, "my_runs=true") {
		t.Errorf("list query %q", q)
	}
	var tr rwxapi.SandboxTokenRequest
	if err := json.Unmarshal(reqs[1].body, &tr); err != nil || tr.RunID != "a" || tr.ExpiresInSeconds != 5400 {
		t.Errorf("token body %s", reqs[1].body)
	}
}

func TestMalformedAnswer(t *testing.T) {
	f := newFakeRemote(t, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(201)
		_, _ = io.WriteString(w, "<html>not json")
	})
	c := f.client(t, nil)
	_, err := c.CreateRun(context.Background(), rwxapi.RunDefinition{}, "k")
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "not the expected JSON") {
		t.Fatalf("err = %v", err)
	}
	if len(f.requests()) != 1 {
		t.Fatalf("malformed POST answer led to %d requests", len(f.requests()))
	}
}

func TestUnpinnedCertificateIsRefused(t *testing.T) {
	f := newFakeRemote(t, func(w http.ResponseWriter, r *http.Request) { writeJSON(w, 200, rwxapi.InitTemplateResult{}) })
	c, err := New(Options{BaseURL: f.srv.URL, Token: testToken, RootCAs: x509.NewCertPool(), MaxRetries: -1})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.InitTemplate(context.Background())
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("err = %v, want a certificate error", err)
	}
	if len(f.requests()) != 0 {
		t.Fatal("a request reached a server whose certificate is not pinned")
	}
}

func TestTokenNeverLogged(t *testing.T) {
	f := newFakeRemote(t, func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(503) })
	var logs bytes.Buffer
	c := f.client(t, func(o *Options) {
		o.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})
	_, err := c.ConnectionInfo(context.Background(), "r", "scoped-secret")
	if err == nil {
		t.Fatal("want an error")
	}
	if logs.Len() == 0 {
		t.Fatal("expected debug logs")
	}
	for _, secret := range []string{testToken, "scoped-secret"} {
		if strings.Contains(logs.String(), secret) || strings.Contains(err.Error(), secret) {
			t.Fatalf("token %q leaked:\n%s\n%v", secret, logs.String(), err)
		}
	}
}

func TestNewValidates(t *testing.T) {
	for _, o := range []Options{
		{BaseURL: "", Token: "t"},
		{BaseURL: "ftp://x", Token: "t"},
		{BaseURL: "http://cloud.example.com", Token: "t"},
		{BaseURL: "https://cloud.example.com"},
		{BaseURL: "https://x", Token: "t", RootCAs: x509.NewCertPool(), HTTPClient: http.DefaultClient},
	} {
		if _, err := New(o); err == nil {
			t.Errorf("New(%+v) accepted", o)
		}
	}
	if _, err := New(Options{BaseURL: "http://127.0.0.1:8080", Token: "t"}); err != nil {
		t.Errorf("loopback http refused: %v", err)
	}
}

// TestRemoteFailuresSayWhatToDo: a 503 (or any 5xx) tells the user it is on
// the remote's side and what to do, not only the status.
func TestRemoteFailuresSayWhatToDo(t *testing.T) {
	for _, c := range []struct {
		status int
		want   string
	}{
		{503, "wait a minute and run the command again"},
		{429, "wait a minute and run the command again"},
		{500, "failed on its side"},
	} {
		msg := (&APIError{Op: "connection info", Status: c.status, Message: "boom"}).Error()
		if !strings.Contains(msg, c.want) || !strings.Contains(msg, "nook config") {
			t.Errorf("%d: %q", c.status, msg)
		}
	}
	if msg := (&APIError{Op: "get run", Status: 404, Message: "no such run"}).Error(); strings.Contains(msg, "wait a minute") {
		t.Errorf("404: %q", msg)
	}
}

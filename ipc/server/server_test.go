package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/ipctest"
	"github.com/sandboxd/sandboxd/ipc/server"
)

func TestMain(m *testing.M) {
	// Helper mode: the peer-UID test re-executes this binary as another
	// user to connect from there.
	if sock := os.Getenv("IPC_TEST_PEER_SOCKET"); sock != "" {
		code, body, err := rawRequest(sock, "GET", "/v1/version", nil, nil)
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
		fmt.Printf("%d %s", code, body)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func httpClient(sock string) *http.Client {
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
}

func rawRequest(sock, method, path string, header http.Header, body io.Reader) (int, []byte, error) {
	code, _, b, err := rawRequestH(sock, method, path, header, body)
	return code, b, err
}

func rawRequestH(sock, method, path string, header http.Header, body io.Reader) (int, http.Header, []byte, error) {
	req, err := http.NewRequest(method, "http://sandboxd"+path, body)
	if err != nil {
		return 0, nil, nil, err
	}
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := httpClient(sock).Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, b, err
}

// expectError checks status, JSON error body and version header.
func expectError(t *testing.T, s *ipctest.Server, method, path string, header http.Header, body string, wantStatus int, wantCode, wantMsg string) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	code, h, b, err := rawRequestH(s.Socket, method, path, header, rd)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	if code != wantStatus {
		t.Fatalf("%s %s: status %d, want %d: %s", method, path, code, wantStatus, b)
	}
	if h.Get(ipc.HeaderVersion) != "test-1" {
		t.Errorf("%s %s: version header %q", method, path, h.Get(ipc.HeaderVersion))
	}
	if ct := h.Get("Content-Type"); ct != "application/json" {
		t.Errorf("%s %s: content type %q", method, path, ct)
	}
	var eb ipc.ErrorBody
	if err := json.Unmarshal(b, &eb); err != nil {
		t.Fatalf("%s %s: error body is not JSON: %s", method, path, b)
	}
	if eb.Error.Code != wantCode || !strings.Contains(eb.Error.Message, wantMsg) {
		t.Errorf("%s %s: error %+v, want code %s and a message containing %q", method, path, eb.Error, wantCode, wantMsg)
	}
}

func start(t *testing.T, o ipctest.Options) *ipctest.Server {
	t.Helper()
	if o.Server.Version == "" {
		o.Server.Version = "test-1"
	}
	return ipctest.Start(t, o)
}

func TestVersionHeaderAndVersion(t *testing.T) {
	s := start(t, ipctest.Options{})
	code, h, b, err := rawRequestH(s.Socket, "GET", "/v1/version", nil, nil)
	if err != nil || code != 200 {
		t.Fatalf("GET /v1/version: %d %v %s", code, err, b)
	}
	if h.Get(ipc.HeaderVersion) != "test-1" {
		t.Fatalf("header %q", h.Get(ipc.HeaderVersion))
	}
	var v ipc.VersionResponse
	if err := json.Unmarshal(b, &v); err != nil || v.Version != "test-1" || v.PID != os.Getpid() || v.GoVersion == "" || v.StartedAt.IsZero() {
		t.Fatalf("version %s (%v)", b, err)
	}
}

func TestUnknownRouteAndMethod(t *testing.T) {
	s := start(t, ipctest.Options{})
	expectError(t, s, "GET", "/v1/nope", nil, "", 404, "not_found", "no route GET /v1/nope")
	expectError(t, s, "GET", "/", nil, "", 404, "not_found", "no route")
	expectError(t, s, "DELETE", "/v1/version", nil, "", 405, "method_not_allowed", "DELETE")
	expectError(t, s, "GET", "/v1/exec", nil, "", 405, "method_not_allowed", "GET")
}

func TestOriginAndRefererRefused(t *testing.T) {
	s := start(t, ipctest.Options{})
	expectError(t, s, "GET", "/v1/version", http.Header{"Origin": {"http://evil.example"}}, "", 403, "unauthorized", "Origin")
	expectError(t, s, "POST", "/v1/sessions/start", http.Header{"Referer": {"http://evil.example/x"}}, `{"cwd":"/"}`, 403, "unauthorized", "Referer")
	if n := len(s.Sessions.Requests()); n != 0 {
		t.Fatalf("a refused request reached the backend (%d calls)", n)
	}
}

func TestStrictJSON(t *testing.T) {
	s := start(t, ipctest.Options{})
	cases := []struct {
		name, body, msg string
	}{
		{"malformed", `{"cwd": "/x",`, "malformed JSON"},
		{"syntax", `{"cwd" "/x"}`, "malformed JSON at byte"},
		{"unknown field", `{"cwd":"/x","bogus":1}`, `unknown field "bogus"`},
		{"wrong type", `{"cwd":42}`, "wrong JSON type for cwd"},
		{"two values", `{"cwd":"/x"} {"cwd":"/y"}`, "more than one JSON value"},
		{"empty", ``, "body is empty"},
		{"relative cwd", `{"cwd":"relative/dir"}`, "not an absolute path"},
		{"no target", `{}`, "cwd or runId is required"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			expectError(t, s, "POST", "/v1/sessions/start", http.Header{"Content-Type": {"application/json"}}, c.body, 400, "invalid", c.msg)
		})
	}
	expectError(t, s, "POST", "/v1/exec", nil, `{"cwd":"/x","argv":[]}`, 400, "invalid", "argv is empty")
	expectError(t, s, "POST", "/v1/exec", nil, `{"cwd":"x","argv":["true"]}`, 400, "invalid", "not an absolute path")
	expectError(t, s, "POST", "/v1/exec", nil, `{"cwd":"/x","argv":["true"],"extra":1}`, 400, "invalid", "unknown field")
	expectError(t, s, "POST", "/v1/sessions/stop", nil, `{"all":true,"runId":"r"}`, 400, "invalid", "do not combine")
	expectError(t, s, "GET", "/v1/sessions?all=maybe", nil, "", 400, "invalid", "not a boolean")
	expectError(t, s, "GET", "/v1/sessions?colour=red", nil, "", 400, "invalid", `unknown query parameter "colour"`)
	expectError(t, s, "GET", "/v1/status?cwd=rel", nil, "", 400, "invalid", "not an absolute path")
	expectError(t, s, "GET", "/v1/events?since=-1", nil, "", 400, "invalid", "not a sequence number")
	if n := len(s.Sessions.Requests()); n != 0 {
		t.Fatalf("invalid requests reached the backend: %v", s.Sessions.Requests())
	}
}

func TestBodyTooLarge(t *testing.T) {
	s := start(t, ipctest.Options{Server: server.Options{MaxBodyBytes: 1024}})
	big := `{"cwd":"/` + strings.Repeat("a", 2000) + `"}`
	expectError(t, s, "POST", "/v1/sessions/start", nil, big, 413, "too_large", "limit of 1024 bytes")
	// Without a Content-Length (chunked), the limit still holds while reading.
	pr, pw := io.Pipe()
	go func() { pw.Write([]byte(big)); pw.Close() }()
	code, b, err := rawRequest(s.Socket, "POST", "/v1/sessions/start", nil, pr)
	if err != nil || code != 413 || !strings.Contains(string(b), "too_large") {
		t.Fatalf("chunked oversized body: %d %v %s", code, err, b)
	}
	// An exec input frame over the limit is refused as well.
	expectError(t, s, "POST", "/v1/exec", nil, `{"cwd":"/x","argv":["`+strings.Repeat("a", 4000)+`"]}`, 413, "too_large", "limit")
}

func TestErrorMapping(t *testing.T) {
	s := start(t, ipctest.Options{})
	cases := []struct {
		err    error
		status int
		code   string
	}{
		{errdefs.Invalidf("bad input"), 400, "invalid"},
		{errdefs.NotFoundf("no such session"), 404, "not_found"},
		{errdefs.Conflictf("already running"), 409, "conflict"},
		{errdefs.Gone(errors.New("run is over")), 410, "gone"},
		{errdefs.Unavailable(errors.New("remote down")), 503, "unavailable"},
		{errdefs.Timeout(errors.New("remote slow")), 504, "timeout"},
		{fmt.Errorf("wrapped: %w", errdefs.NotFoundf("deep")), 404, "not_found"},
		{errors.New("plain failure"), 500, "internal"},
		{fmt.Errorf("waiting: %w", context.DeadlineExceeded), 504, "timeout"},
	}
	for _, c := range cases {
		s.Sessions.StartFn = func(context.Context, ipc.StartRequest) (ipc.StartResponse, error) { return ipc.StartResponse{}, c.err }
		expectError(t, s, "POST", "/v1/sessions/start", nil, `{"cwd":"/x"}`, c.status, c.code, c.err.Error())
	}
}

func TestNilBackendsAnswer503(t *testing.T) {
	s := start(t, ipctest.Options{NoSessions: true, NoEvents: true})
	expectError(t, s, "GET", "/v1/sessions", nil, "", 503, "unavailable", "sessions are not available")
	expectError(t, s, "POST", "/v1/exec", nil, `{"cwd":"/x","argv":["true"]}`, 503, "unavailable", "sessions are not available")
	expectError(t, s, "GET", "/v1/events", nil, "", 503, "unavailable", "events are not available")
	if code, _, err := rawRequest(s.Socket, "GET", "/v1/health", nil, nil); err != nil || code != 200 {
		t.Fatalf("health with a daemon backend: %d %v", code, err)
	}
}

func TestRoutesReachBackends(t *testing.T) {
	s := start(t, ipctest.Options{})
	for _, c := range []struct {
		method, path, body string
		want               int
	}{
		{"GET", "/v1/health", "", 200},
		{"GET", "/v1/config", "", 200},
		{"POST", "/v1/sessions/start", `{"cwd":"/a/../b","wait":true}`, 201},
		{"POST", "/v1/sessions/reset", `{"cwd":"/b"}`, 201},
		{"GET", "/v1/sessions?all=true", "", 200},
		{"POST", "/v1/sessions/stop", `{"all":true}`, 200},
		{"GET", "/v1/sessions/s1/probe", "", 200},
		{"GET", "/v1/sessions/nope/probe", "", 404},
		{"GET", "/v1/status?cwd=/b&configFile=c.yml", "", 200},
		{"POST", "/v1/init", `{"cwd":"/b"}`, 201},
		{"POST", "/v1/reconcile", "", 200},
		{"POST", "/v1/daemon/stop", "", 202},
		{"GET", "/v1/openapi.yaml", "", 200},
	} {
		var rd io.Reader
		if c.body != "" {
			rd = strings.NewReader(c.body)
		}
		code, b, err := rawRequest(s.Socket, c.method, c.path, nil, rd)
		if err != nil || code != c.want {
			t.Errorf("%s %s: %d %v %s, want %d", c.method, c.path, code, err, b, c.want)
		}
	}
	reqs := s.Sessions.Requests()
	if st, ok := reqs[0].(ipc.StartRequest); !ok || st.Cwd != "/b" || !st.Wait {
		t.Errorf("start request reached the backend as %#v (cwd must be cleaned)", reqs[0])
	}
	if s.Daemon.Shutdowns() != 1 {
		t.Errorf("daemon stop called %d times", s.Daemon.Shutdowns())
	}
}

// TestPeerUIDRefused connects from user nobody (the test binary re-executed
// with another UID) and expects a 403 naming both UIDs.
func TestPeerUIDRefused(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to run a client as another user; the UID check is covered by TestPeerUIDAllowedOnly")
	}
	s := start(t, ipctest.Options{DirMode: 0o755, SocketMode: 0o666})
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// The test binary's build directory is private to root: copy it where
	// nobody can run it.
	bin := filepath.Join(s.Dir, "peer.test")
	data, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin)
	cmd.Env = []string{"IPC_TEST_PEER_SOCKET=" + s.Socket, "HOME=" + s.Dir}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("client as nobody: %v\n%s", err, out)
	}
	got := string(out)
	if !strings.HasPrefix(got, "403 ") || !strings.Contains(got, `"unauthorized"`) || !strings.Contains(got, "uid 65534") || !strings.Contains(got, "uid 0") {
		t.Fatalf("client as nobody got %q, want a 403 naming uid 65534 and uid 0", got)
	}
}

// TestPeerUIDAllowedOnly serves only another UID: this process is refused.
func TestPeerUIDAllowedOnly(t *testing.T) {
	other := os.Getuid() + 1
	s := start(t, ipctest.Options{Server: server.Options{AllowedUID: &other}})
	expectError(t, s, "GET", "/v1/version", nil, "", 403, "unauthorized", fmt.Sprintf("uid %d", os.Getuid()))
}

func TestHandlerWithoutPeerCredentialsRefuses(t *testing.T) {
	srv := server.New(server.Backends{}, server.Options{Version: "test-1"})
	rec := &recorder{header: http.Header{}}
	req, _ := http.NewRequest("GET", "/v1/version", nil)
	srv.Handler().ServeHTTP(rec, req)
	if rec.status != 403 || !bytes.Contains(rec.body.Bytes(), []byte("peer credentials")) {
		t.Fatalf("got %d %s", rec.status, rec.body.String())
	}
}

type recorder struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (r *recorder) Header() http.Header         { return r.header }
func (r *recorder) Write(b []byte) (int, error) { return r.body.Write(b) }
func (r *recorder) WriteHeader(s int)           { r.status = s }

func execFrames(t *testing.T, s *ipctest.Server, body string) []ipc.ExecOutput {
	t.Helper()
	code, h, b, err := rawRequestH(s.Socket, "POST", "/v1/exec", nil, strings.NewReader(body))
	if err != nil || code != 200 || h.Get("Content-Type") != ipc.ContentTypeNDJSON {
		t.Fatalf("exec: %d %v %q %s", code, err, h.Get("Content-Type"), b)
	}
	var frames []ipc.ExecOutput
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var f ipc.ExecOutput
		if err := json.Unmarshal([]byte(line), &f); err != nil {
			t.Fatalf("frame %q: %v", line, err)
		}
		frames = append(frames, f)
	}
	return frames
}

// A single plain JSON object (curl -d) is an exec without stdin.
func TestExecPlainJSONBody(t *testing.T) {
	s := start(t, ipctest.Options{})
	s.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		in, _ := io.ReadAll(st.Stdin())
		io.WriteString(st.Stdout(), fmt.Sprintf("argv=%q stdin=%q", req.Argv, in))
		return ipc.ExecResult{RunID: "run-1", ExitCode: 7}, nil
	}
	frames := execFrames(t, s, "{\n  \"cwd\": \"/x\",\n  \"argv\": [\"printf\", \"%s\", \"a b\"]\n}")
	if len(frames) != 2 || frames[0].Type != ipc.ExecStdout || string(frames[0].Data) != `argv=["printf" "%s" "a b"] stdin=""` {
		t.Fatalf("frames %+v", frames)
	}
	if frames[1].Type != ipc.ExecExit || frames[1].Result.ExitCode != 7 || frames[1].Result.PulledFiles == nil {
		t.Fatalf("last frame %+v", frames[1])
	}
}

// A malformed input frame ends the exec with an invalid error frame.
func TestExecMalformedInputFrame(t *testing.T) {
	s := start(t, ipctest.Options{})
	s.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		st.Send(ipc.ExecOutput{Type: ipc.ExecStarted})
		_, err := io.Copy(io.Discard, st.Stdin())
		if err == nil {
			<-ctx.Done()
			err = ctx.Err()
		}
		return ipc.ExecResult{}, errdefs.Canceled(err)
	}
	for _, c := range []struct{ frame, msg string }{
		{`{"stdin":"%%%"}`, "exec input frame 1"},
		{`{"signal":"BOGUS"}`, `unknown signal "BOGUS"`},
		{`{"stdinEof":true,"extra":1}`, "unknown field"},
	} {
		frames := execFrames(t, s, `{"cwd":"/x","argv":["cat"],"stdin":true}`+"\n"+c.frame+"\n")
		last := frames[len(frames)-1]
		if last.Type != ipc.ExecError || last.Error.Code != "invalid" || !strings.Contains(last.Error.Message, c.msg) {
			t.Errorf("frame %s: last frame %+v, want an invalid error containing %q", c.frame, last.Error, c.msg)
		}
	}
}

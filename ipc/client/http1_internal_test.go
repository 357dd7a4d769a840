package client

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"testing"
	"testing/iotest"
)

// The tests here may use net/http: they check the client's own HTTP/1.1
// against it, and test code is not linked into nook.

// readAll reads a response from raw and its whole body (at most limit
// bytes, so that a test of a hostile answer cannot grow without end).
func readAll(raw string, limit int64) (*response, []byte, error) {
	resp, err := readResponse(bufio.NewReader(strings.NewReader(raw)))
	if err != nil {
		return nil, nil, err
	}
	if resp.body == nil {
		return resp, nil, nil
	}
	b, err := io.ReadAll(io.LimitReader(resp.body, limit))
	return resp, b, err
}

func TestReadResponseFramesBodies(t *testing.T) {
	for _, tc := range []struct {
		name, raw  string
		status     int
		body, rest string // rest: what is left on the connection
		version    string
	}{
		{"content-length", "HTTP/1.1 200 OK\r\nSandboxd-Version: v1\r\nContent-Length: 5\r\n\r\nhello+extra", 200, "hello", "+extra", "v1"},
		{"content-length 0", "HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n", 202, "", "", ""},
		{"same content-length twice", "HTTP/1.1 200 OK\r\nContent-Length: 2\r\ncontent-length:  2 \r\n\r\nokNO", 200, "ok", "NO", ""},
		{"chunked", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n1;ext=1;x\r\n \r\nA  \r\n0123456789\r\n0\r\n\r\nNEXT", 200, "hello 0123456789", "NEXT", ""},
		{"chunked, upper-case hex and a trailer", "HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-Trailer: 1\r\nY: 2\r\n\r\nNEXT", 200, "abcdefghijklmnopqrstuvwxyz", "NEXT", ""},
		{"chunked wins over content-length", "HTTP/1.1 200 OK\r\nContent-Length: 100\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", 200, "ok", "", ""},
		{"until close", "HTTP/1.1 200 OK\r\nSandboxd-Version: v2\r\n\r\nall of it\r\n", 200, "all of it\r\n", "", "v2"},
		{"bare LF head", "HTTP/1.1 404 Not Found\nContent-Length: 2\n\n{}", 404, "{}", "", ""},
		{"no reason phrase", "HTTP/1.1 200\r\nContent-Length: 0\r\n\r\n", 200, "", "", ""},
		{"204 has no body", "HTTP/1.1 204 No Content\r\nContent-Length: 7\r\n\r\nnot it", 204, "", "not it", ""},
		{"1xx skipped", "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", 200, "ok", "", ""},
		{"HTTP/1.0 ignores Transfer-Encoding", "HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", 200, "2\r\nok\r\n0\r\n\r\n", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			br := bufio.NewReader(strings.NewReader(tc.raw))
			resp, err := readResponse(br)
			if err != nil {
				t.Fatal(err)
			}
			body, err := io.ReadAll(resp.body)
			if err != nil {
				t.Fatalf("body: %v", err)
			}
			rest, _ := io.ReadAll(br)
			if resp.status != tc.status || string(body) != tc.body || string(rest) != tc.rest || resp.header.get("Sandboxd-Version") != tc.version {
				t.Fatalf("status %d body %q rest %q version %q, want %d %q %q %q", resp.status, body, rest, resp.header.get("Sandboxd-Version"), tc.status, tc.body, tc.rest, tc.version)
			}
			// net/http reads the same answer the same way (but for the
			// 1xx answers, which its transport skips, not ReadResponse).
			if tc.name == "1xx skipped" {
				return
			}
			hresp, err := http.ReadResponse(bufio.NewReader(strings.NewReader(tc.raw)), nil)
			if err != nil {
				t.Fatalf("net/http: %v", err)
			}
			hbody, err := io.ReadAll(hresp.Body)
			if err != nil || hresp.StatusCode != tc.status || string(hbody) != tc.body {
				t.Fatalf("net/http reads %d %q (%v)", hresp.StatusCode, hbody, err)
			}
		})
	}
}

// An upgrade's answer ends at its head: what follows is the new protocol,
// already partly in the reader's buffer, and must reach the caller.
func TestReadResponseUpgradeLeavesTheStream(t *testing.T) {
	br := bufio.NewReader(strings.NewReader("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: sandboxd-ssh\r\nSandboxd-Version: v3\r\n\r\nSSH-2.0-OpenSSH_9.6\r\nmore"))
	resp, err := readResponse(br)
	if err != nil || resp.status != 101 || resp.body != nil || resp.header.get("Upgrade") != "sandboxd-ssh" {
		t.Fatalf("%+v %v", resp, err)
	}
	if br.Buffered() == 0 {
		t.Fatal("the test means the stream's first bytes to be buffered with the head")
	}
	u := &upgraded{br: br}
	got, err := io.ReadAll(u)
	if err != nil || string(got) != "SSH-2.0-OpenSSH_9.6\r\nmore" {
		t.Fatalf("stream %q %v", got, err)
	}
}

func TestReadResponseRefusesMalformedAnswers(t *testing.T) {
	long := strings.Repeat("x", maxHeadLine)
	many := strings.Repeat("X-Filler: "+strings.Repeat("y", 1000)+"\r\n", maxHeadBytes/1000)
	for _, tc := range []struct {
		name, raw string
		want      string // in the error
		cut       bool   // an early end (wraps io.ErrUnexpectedEOF), not a *ProtocolError
	}{
		{"nothing", "", "closed before an answer", false},
		{"not HTTP", "SSH-2.0-OpenSSH_9.6\r\n\r\n", "does not start with HTTP/1.x", false},
		{"HTTP/2", "HTTP/2.0 200 OK\r\n\r\n", "does not start with HTTP/1.x", false},
		{"two-digit status", "HTTP/1.1 20 OK\r\n\r\n", "no three-digit status", false},
		{"status with a letter", "HTTP/1.1 2x0 OK\r\n\r\n", "no three-digit status", false},
		{"status 099", "HTTP/1.1 099 OK\r\n\r\n", "no three-digit status", false},
		{"head cut in the status line", "HTTP/1.1 200", "ended within its head", true},
		{"head cut in the headers", "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n", "ended within its head", true},
		{"header without colon", "HTTP/1.1 200 OK\r\nContent-Length 2\r\n\r\n", "malformed header line", false},
		{"space in a name", "HTTP/1.1 200 OK\r\nContent Length: 2\r\n\r\n", "malformed header line", false},
		{"space before the colon", "HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\n", "malformed header line", false},
		{"empty name", "HTTP/1.1 200 OK\r\n: 2\r\n\r\n", "malformed header line", false},
		{"folded line", "HTTP/1.1 200 OK\r\nX-A: 1\r\n 2\r\n\r\n", "obsolete line folding", false},
		{"control character", "HTTP/1.1 200 OK\r\nX-A: 1\x002\r\n\r\n", "control character", false},
		{"line too long", "HTTP/1.1 200 OK\r\nX-Long: " + long + "\r\n\r\n", "longer than 8192 bytes", false},
		{"head too long", "HTTP/1.1 200 OK\r\n" + many + "\r\n", "head longer than 65536 bytes", false},
		{"too many 1xx", strings.Repeat("HTTP/1.1 100 Continue\r\n\r\n", 6) + "HTTP/1.1 200 OK\r\n\r\n", "informational", false},
		{"bad length", "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad Content-Length", false},
		{"length with a sign", "HTTP/1.1 200 OK\r\nContent-Length: +1\r\n\r\nx", "bad Content-Length", false},
		{"empty length", "HTTP/1.1 200 OK\r\nContent-Length:\r\n\r\n", "bad Content-Length", false},
		{"length list", "HTTP/1.1 200 OK\r\nContent-Length: 1, 1\r\n\r\nx", "bad Content-Length", false},
		{"conflicting lengths", "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nxx", "conflicting Content-Length", false},
		{"conflicting lengths on a 204", "HTTP/1.1 204 No Content\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "conflicting Content-Length", false},
		{"gzip", "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "unsupported transfer encoding", false},
		{"chunked twice", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "unsupported transfer encoding", false},
		{"body cut", "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello", "ended within its body", true},
		{"chunk size not hex", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n", "bad chunk size line", false},
		{"chunk size empty", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n;ext\r\nhello\r\n0\r\n\r\n", "bad chunk size line", false},
		{"chunk size negative", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n", "bad chunk size line", false},
		{"chunk size space before the extension", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5 ;x\r\nhello\r\n0\r\n\r\n", "bad chunk size line", false},
		{"chunk size of 17 digits", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n00000000000000005\r\nhello\r\n0\r\n\r\n", "bad chunk size line", false},
		{"chunk size over int64", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\nhello\r\n0\r\n\r\n", "bad chunk size line", false},
		{"chunk size with a bare LF", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\nhello\r\n0\r\n\r\n", "does not end in CRLF", false},
		{"empty chunk size line with a bare LF", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\n", "does not end in CRLF", false},
		{"CR inside a chunk size line", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;a\rb\r\nhello\r\n0\r\n\r\n", "does not end in CRLF", false},
		{"chunk size line too long", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;" + strings.Repeat("e", maxChunkLine) + "\r\nhello\r\n0\r\n\r\n", "chunk size line longer than 4096 bytes", false},
		{"chunk data longer than its size", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nhello\r\n0\r\n\r\n", "longer than its size", false},
		{"chunk data with a bare LF", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\n0\r\n\r\n", "not followed by CRLF", false},
		{"chunk cut", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel", "ended within its body", true},
		{"chunk end cut", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r", "ended within its body", true},
		{"no last chunk", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", "ended within its body", true},
		{"trailer cut", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n", "ended within its body", true},
		{"malformed trailer", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nnot a field\r\n\r\n", "malformed trailer field line", false},
		{"trailer with a bare LF", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX: 1\n\r\n", "does not end in CRLF", false},
		{"trailer too long", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n" + strings.Repeat("X-T: "+strings.Repeat("t", 100)+"\r\n", 50) + "\r\n", "trailer longer than 4096 bytes", false},
		{"chunks that are mostly extensions", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + strings.Repeat("1;"+strings.Repeat("e", 1000)+"\r\nx\r\n", 20) + "0\r\n\r\n", "too much besides its data", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, body, err := readAll(tc.raw, 1<<20)
			if err == nil {
				t.Fatalf("read %q without an error", body)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q, want it to say %q", err, tc.want)
			}
			var pe *ProtocolError
			switch {
			case tc.cut && !errors.Is(err, io.ErrUnexpectedEOF):
				t.Fatalf("an early end %v does not wrap io.ErrUnexpectedEOF", err)
			case !tc.cut && tc.name != "nothing" && !errors.As(err, &pe):
				t.Fatalf("error %v (%T) is not a *ProtocolError", err, err)
			}
		})
	}
}

// Bodies that come a byte at a time (a stream, as exec frames come) or
// with each read cut short decode the same.
func TestChunkedBodyInSmallReads(t *testing.T) {
	var wire bytes.Buffer
	cw := httputil.NewChunkedWriter(&wire)
	var want []byte
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 50 {
		p := bytes.Repeat([]byte{byte('a' + i%26)}, 1+rng.IntN(300))
		want = append(want, p...)
		_, _ = cw.Write(p)
	}
	_ = cw.Close()
	wire.WriteString("\r\n")
	for name, r := range map[string]io.Reader{
		"one byte": iotest.OneByteReader(bytes.NewReader(wire.Bytes())),
		"half":     iotest.HalfReader(bytes.NewReader(wire.Bytes())),
	} {
		got, err := io.ReadAll(&chunkedReader{br: bufio.NewReaderSize(r, 16)})
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("%s: %d bytes (%v), want %d", name, len(got), err, len(want))
		}
	}
}

func TestRequestIsWhatNetHTTPReads(t *testing.T) {
	for _, r := range []request{
		{method: methodGet, path: "/v1/version"},
		{method: methodGet, path: "/v1/status", query: params{"cwd": "/a b/ü&x=y", "configFile": "c+d.yml", "runId": "r?#1"}},
		{method: methodPost, path: "/v1/reconcile"},
		{method: methodPost, path: "/v1/sessions/start", contentType: "application/json", body: []byte(`{"cwd":"/r"}`)},
		{method: methodPost, path: "/v1/exec", contentType: "application/x-ndjson", chunked: true},
		{method: methodPost, path: "/v1/ssh/proxy", contentType: "application/json", body: []byte(`{"host":"h"}`), upgrade: "sandboxd-ssh"},
		{method: methodGet, path: "/v1/sessions/" + escape("a/b c?d", false) + "/probe"},
	} {
		raw := appendRequest(nil, r, "nook/1.0\r\nX-Injected: 1")
		if r.chunked {
			raw = append(raw, "4\r\nbody\r\n0\r\n\r\n"...)
		}
		hr, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(raw)))
		if err != nil {
			t.Fatalf("%s %s: net/http cannot read %q: %v", r.method, r.path, raw, err)
		}
		body, _ := io.ReadAll(hr.Body)
		wantBody := string(r.body)
		if r.chunked {
			wantBody = "body"
		}
		q := url.Values{}
		for k, v := range r.query {
			q.Set(k, v)
		}
		if hr.Method != r.method || hr.URL.EscapedPath() != r.path || hr.URL.RawQuery != q.Encode() || hr.Host != "sandboxd" ||
			hr.UserAgent() != "nook/1.0X-Injected: 1" || hr.Header.Get("X-Injected") != "" || hr.Header.Get("Content-Type") != r.contentType || string(body) != wantBody {
			t.Fatalf("net/http read %s %s?%s UA %q type %q body %q from %q", hr.Method, hr.URL.EscapedPath(), hr.URL.RawQuery, hr.UserAgent(), hr.Header.Get("Content-Type"), body, raw)
		}
		for k, v := range r.query {
			if got := hr.URL.Query().Get(k); got != v {
				t.Fatalf("query %s: got %q, want %q", k, got, v)
			}
		}
		switch {
		case r.upgrade != "":
			if hr.Header.Get("Connection") != "Upgrade" || hr.Header.Get("Upgrade") != r.upgrade {
				t.Fatalf("upgrade headers %v", hr.Header)
			}
		case !hr.Close:
			t.Fatalf("%s %s: the request does not ask to close the connection", r.method, r.path)
		}
		if r.method == methodPost && !r.chunked && hr.ContentLength != int64(len(r.body)) {
			t.Fatalf("%s %s: Content-Length %d, want %d", r.method, r.path, hr.ContentLength, len(r.body))
		}
	}
}

func TestEscapeIsNetURLs(t *testing.T) {
	all := make([]byte, 256)
	for i := range all {
		all[i] = byte(i)
	}
	for _, s := range []string{"", "plain", "a b", "/abs/path with space", "x+y&z=w?#%", "ü€", string(all)} {
		if got, want := escape(s, true), url.QueryEscape(s); got != want {
			t.Errorf("query %q: %q, want %q", s, got, want)
		}
		if got, want := escape(s, false), url.PathEscape(s); got != want {
			t.Errorf("path %q: %q, want %q", s, got, want)
		}
	}
	p := params{"runId": "r 1", "cwd": "/a&b", "configFile": "c=d"}
	q := url.Values{}
	for k, v := range p {
		q.Set(k, v)
	}
	if p.encode() != q.Encode() {
		t.Errorf("params %q, want %q", p.encode(), q.Encode())
	}
}

func TestStatusTextIsNetHTTPs(t *testing.T) {
	for code := 100; code < 600; code++ {
		if got, want := statusText(code), http.StatusText(code); got != want {
			t.Errorf("%d: %q, want %q", code, got, want)
		}
	}
}

// FuzzReadResponse: whatever answers on the socket, the reader gives a
// response or an error, never a panic or a loop; and what it accepts,
// net/http reads the same way (the client is at least as strict).
func FuzzReadResponse(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n0\r\nT: 1\r\n\r\n",
		"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n{\"type\":\"exit\"}\n\r\n0\r\n\r\n",
		"HTTP/1.1 400 Bad Request\r\nContent-Length: 2\r\n\r\n{}",
		"HTTP/1.1 101 Switching Protocols\r\nUpgrade: sandboxd-ssh\r\n\r\nSSH",
		"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
		"HTTP/1.0 200 OK\r\n\r\nuntil close",
		"HTTP/1.1 200 OK\nContent-Length: 1\n\nx",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		resp, body, err := readAll(string(raw), 1<<20)
		if err != nil {
			if err.Error() == "" {
				t.Fatal("an empty error")
			}
			return
		}
		if !bytes.HasPrefix(raw, []byte("HTTP/1.1 ")) {
			return
		}
		hresp, herr := http.ReadResponse(bufio.NewReader(bytes.NewReader(raw)), nil)
		if herr != nil {
			t.Fatalf("accepted %q (status %d, body %q), which net/http refuses: %v", raw, resp.status, body, herr)
		}
		if hresp.StatusCode/100 == 1 && hresp.StatusCode != 101 {
			return // net/http's transport skips these, not ReadResponse
		}
		hbody, herr := io.ReadAll(io.LimitReader(hresp.Body, 1<<20))
		if herr != nil || hresp.StatusCode != resp.status || !bytes.Equal(hbody, body) {
			t.Fatalf("%q: read as %d %q; net/http reads %d %q (%v)", raw, resp.status, body, hresp.StatusCode, hbody, herr)
		}
	})
}

// FuzzChunkedBody: the chunked decoder against net/http's. Whatever it
// decodes, net/http decodes to the same bytes; whatever net/http refuses,
// it refuses. (It may refuse more: it also reads the trailer, which
// net/http's decoder leaves to its caller.)
func FuzzChunkedBody(f *testing.F) {
	for _, s := range []string{
		"5\r\nhello\r\n0\r\n\r\n",
		"5;ext=\"v\"\r\nhello\r\n1 \r\n \r\n0\r\nTrailer: x\r\n\r\n",
		"A\r\n0123456789\r\n0\r\n\r\n",
		"5\nhello\r\n0\r\n\r\n",
		"3\r\nhello\r\n0\r\n\r\n",
		"\r\n",
		"0000000000000000005\r\nhello\r\n0\r\n\r\n",
		"1;" + strings.Repeat("x", 5000) + "\r\na\r\n0\r\n\r\n",
		// Chunks carrying 986 bytes of overhead each: 16 are within the
		// bound on overhead, 17 beyond it.
		strings.Repeat("1;"+strings.Repeat("e", 1000)+"\r\nx\r\n", 16) + "0\r\n\r\n",
		strings.Repeat("1;"+strings.Repeat("e", 1000)+"\r\nx\r\n", 17) + "0\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		got, err := io.ReadAll(io.LimitReader(&chunkedReader{br: bufio.NewReader(bytes.NewReader(raw))}, 1<<20))
		want, werr := io.ReadAll(io.LimitReader(httputil.NewChunkedReader(bytes.NewReader(raw)), 1<<20))
		switch {
		case err == nil && (werr != nil || !bytes.Equal(got, want)):
			t.Fatalf("%q: decoded %q; net/http: %q (%v)", raw, got, want, werr)
		case werr != nil && err == nil:
			t.Fatalf("%q: decoded what net/http refuses (%v)", raw, werr)
		case err != nil && werr == nil && !bytes.Equal(got, want):
			t.Fatalf("%q: refused (%v) within the data net/http decodes as %q; got %q", raw, err, want, got)
		case err != nil && err.Error() == "":
			t.Fatal("an empty error")
		}
	})
}

// ExampleProtocolError shows what a caller sees of a garbled answer.
func ExampleProtocolError() {
	_, err := readResponse(bufio.NewReader(strings.NewReader("SSH-2.0-OpenSSH_9.6\r\n")))
	fmt.Println(err)
	// Output: sandboxd's answer is not valid HTTP/1.1: status line "SSH-2.0-OpenSSH_9.6" does not start with HTTP/1.x
}

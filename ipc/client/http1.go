package client

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
)

// The client speaks HTTP/1.1 itself, one request per connection, rather than
// through net/http: nook starts on every command an agent runs, and net/http
// (with the TLS, MIME and proxy packages it links) costs each start its
// package initialisation and the page faults of a larger binary. Only what
// sandboxd's socket API uses is here: requests with a whole body
// (Content-Length) or a streamed one (chunked), and answers delimited by
// Content-Length, chunked encoding or the connection's end, or a 101 that
// hands the connection over.

// Bounds on what is read of an answer's head. sandboxd's heads are a few
// hundred bytes; a peer that sends more is not sandboxd, and must not make
// the client buffer without end.
const (
	maxHeadLine  = 8 << 10  // one status or header line
	maxHeadBytes = 64 << 10 // a whole head
	// A chunk-size line and a trailer are bounded as net/http bounds them
	// (the size of its reader's buffer).
	maxChunkLine    = 4 << 10
	maxTrailerBytes = 4 << 10
	// maxChunkOverhead bounds what a chunked body carries beyond its data
	// (sizes, extensions), as net/http does: a peer sending a stream of
	// tiny chunks with long extensions is not sandboxd.
	maxChunkOverhead = 16 << 10
	// maxInformational bounds the 1xx answers (but 101) skipped before the
	// real one.
	maxInformational = 5
)

// ProtocolError says an answer is not the HTTP/1.1 that sandboxd speaks:
// something else serves the socket, or the answer is garbled (an answer
// cut short is an error wrapping io.ErrUnexpectedEOF instead).
type ProtocolError struct{ Reason string }

func (e *ProtocolError) Error() string {
	return "sandboxd's answer is not valid HTTP/1.1: " + e.Reason
}

// How an answer can end too early. Each wraps io.EOF or io.ErrUnexpectedEOF.
// (Literals rather than fmt.Errorf: they cost nook's start nothing.)
var (
	errNoAnswer error = &earlyEnd{"the connection closed before an answer", io.EOF}
	errHeadCut  error = &earlyEnd{"the answer ended within its head", io.ErrUnexpectedEOF}
	errBodyCut  error = &earlyEnd{"the answer ended within its body", io.ErrUnexpectedEOF}
)

// earlyEnd is an answer that ended before its framing said it would.
type earlyEnd struct {
	what string
	err  error
}

func (e *earlyEnd) Error() string { return e.what + ": " + e.err.Error() }
func (e *earlyEnd) Unwrap() error { return e.err }

func protocolErrorf(format string, a ...any) error {
	return &ProtocolError{Reason: fmt.Sprintf(format, a...)}
}

// request is one request as the client writes it.
type request struct {
	method, path string
	query        params
	contentType  string
	// body is sent whole with its Content-Length; chunked says instead that
	// the body follows the head as chunks, written by the caller.
	body    []byte
	chunked bool
	// upgrade asks to switch the connection to this protocol.
	upgrade string
}

// appendRequest appends r's head, and its body when whole, to b.
func appendRequest(b []byte, r request, userAgent string) []byte {
	b = append(b, r.method...)
	b = append(b, ' ')
	b = append(b, r.path...)
	if q := r.query.encode(); q != "" {
		b = append(b, '?')
		b = append(b, q...)
	}
	b = append(b, " HTTP/1.1\r\nHost: sandboxd\r\nUser-Agent: "...)
	b = append(b, headerSafe(userAgent)...)
	b = append(b, "\r\n"...)
	if r.contentType != "" {
		b = append(b, "Content-Type: "...)
		b = append(b, r.contentType...)
		b = append(b, "\r\n"...)
	}
	if r.upgrade != "" {
		b = append(b, "Connection: Upgrade\r\nUpgrade: "...)
		b = append(b, r.upgrade...)
		b = append(b, "\r\n"...)
	} else {
		// One request per connection: the daemon closes it after
		// answering, which also ends an answer that has no length.
		b = append(b, "Connection: close\r\n"...)
	}
	switch {
	case r.chunked:
		b = append(b, "Transfer-Encoding: chunked\r\n\r\n"...)
		return b
	case r.body != nil || r.method == methodPost:
		// A POST without a body says so, as net/http does.
		b = append(b, "Content-Length: "...)
		b = strconv.AppendInt(b, int64(len(r.body)), 10)
		b = append(b, "\r\n"...)
	}
	b = append(b, "\r\n"...)
	return append(b, r.body...)
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

// params are a request's query parameters, one value each.
type params map[string]string

// encode is url.Values.Encode: sorted by name, each escaped as a query
// component.
func (p params) encode() string {
	if len(p) == 0 {
		return ""
	}
	names := make([]string, 0, len(p))
	for k := range p {
		names = append(names, k)
	}
	slices.Sort(names)
	var b strings.Builder
	for i, k := range names {
		if i > 0 {
			b.WriteByte('&')
		}
		b.WriteString(escape(k, true))
		b.WriteByte('=')
		b.WriteString(escape(p[k], true))
	}
	return b.String()
}

// escape is net/url's QueryEscape (query) or PathEscape (!query): what the
// daemon's URL parsing undoes.
func escape(s string, query bool) string {
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == ' ' && query:
			b.WriteByte('+')
		case shouldEscape(c, query):
			b.WriteByte('%')
			b.WriteByte(hex[c>>4])
			b.WriteByte(hex[c&15])
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}

// shouldEscape is net/url's rule for a query component or a path segment.
func shouldEscape(c byte, query bool) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return false
	}
	switch c {
	case '-', '_', '.', '~':
		return false
	case '$', '&', '+', ',', '/', ':', ';', '=', '?', '@':
		if query {
			return true
		}
		return c == '/' || c == ';' || c == ',' || c == '?'
	}
	return true
}

// header holds an answer's fields by lower-case name.
type header map[string][]string

// get is the first value of the field name (in any case), "" when absent.
func (h header) get(name string) string {
	if v := h[strings.ToLower(name)]; len(v) > 0 {
		return v[0]
	}
	return ""
}

// response is an answer's head and its body.
type response struct {
	status int
	header header
	// body yields the body as its framing delimits it: io.EOF at its end,
	// io.ErrUnexpectedEOF or a *ProtocolError when it is cut or garbled.
	// After a 101 it is nil: the connection (the reader it was parsed
	// from, then the connection itself) carries the new protocol.
	body io.Reader
}

// readResponse reads an answer's head from br and frames its body.
// Informational answers (1xx but 101) are skipped, as net/http does.
func readResponse(br *bufio.Reader) (*response, error) {
	head := newBudget(maxHeadBytes, "head")
	for skipped := 0; ; skipped++ {
		line, err := readLine(br, maxHeadLine, head, "status line")
		line = bytes.TrimSuffix(line, []byte("\r"))
		switch {
		case errors.Is(err, io.EOF) && skipped == 0:
			return nil, errNoAnswer
		case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
			return nil, errHeadCut
		case err != nil:
			return nil, err
		}
		status, http11, err := parseStatusLine(line)
		if err != nil {
			return nil, err
		}
		h, err := readHeader(br, head, "header")
		if err != nil {
			return nil, err
		}
		if status >= 100 && status < 200 && status != 101 {
			if skipped >= maxInformational {
				return nil, protocolErrorf("more than %d informational (1xx) answers before the answer", maxInformational)
			}
			continue
		}
		resp := &response{status: status, header: h}
		if status == 101 {
			return resp, nil
		}
		resp.body, err = bodyReader(br, http11, status, h)
		if err != nil {
			return nil, err
		}
		return resp, nil
	}
}

// parseStatusLine reads "HTTP/1.x NNN reason"; http11 is x >= 1.
func parseStatusLine(line []byte) (status int, http11 bool, err error) {
	proto, rest, _ := bytes.Cut(line, []byte(" "))
	if len(proto) != len("HTTP/1.1") || !bytes.HasPrefix(proto, []byte("HTTP/1.")) || !isDigits(proto[7:]) {
		return 0, false, protocolErrorf("status line %q does not start with HTTP/1.x", truncate(line))
	}
	code, _, _ := bytes.Cut(rest, []byte(" "))
	if len(code) != 3 || !isDigits(code) || code[0] == '0' {
		return 0, false, protocolErrorf("status line %q has no three-digit status", truncate(line))
	}
	n, _ := strconv.Atoi(string(code))
	return n, proto[7] >= '1', nil
}

// readHeader reads header (or trailer) fields up to the empty line. Lines
// end in CRLF or, in a head (as net/http accepts), in a bare LF.
func readHeader(br *bufio.Reader, b *budget, what string) (header, error) {
	h := header{}
	for {
		line, err := readLine(br, maxHeadLine, b, what)
		if err == nil && b.of == "trailer" && !bytes.HasSuffix(line, []byte("\r")) {
			return nil, protocolErrorf("trailer line %q does not end in CRLF", truncate(line))
		}
		line = bytes.TrimSuffix(line, []byte("\r"))
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			if b.of == "trailer" {
				return nil, errBodyCut
			}
			return nil, errHeadCut
		}
		if err != nil {
			return nil, err
		}
		if len(line) == 0 {
			return h, nil
		}
		if line[0] == ' ' || line[0] == '\t' {
			return nil, protocolErrorf("%s line %q continues the one before (obsolete line folding)", what, truncate(line))
		}
		name, value, ok := bytes.Cut(line, []byte(":"))
		if !ok || len(name) == 0 || !isToken(name) {
			return nil, protocolErrorf("malformed %s line %q", what, truncate(line))
		}
		value = bytes.Trim(value, " \t")
		for _, c := range value {
			if c < ' ' && c != '\t' || c == 0x7f {
				return nil, protocolErrorf("%s %s holds a control character", what, name)
			}
		}
		k := strings.ToLower(string(name))
		h[k] = append(h[k], string(value))
	}
}

// budget is what is left of the bytes allowed for a head or a trailer.
type budget struct {
	left, max int
	of        string // "head" or "trailer"
}

func newBudget(max int, of string) *budget { return &budget{left: max, max: max, of: of} }

// readLine reads one line, without its LF, of at most limit bytes with its
// LF and within what is left of b (nil: no budget). A CR before the LF is
// left for the caller: a head's lines may end in a bare LF, as net/http
// accepts, a chunked body's lines may not. io.EOF means the input ended before
// the line began; io.ErrUnexpectedEOF that it ended within.
func readLine(br *bufio.Reader, limit int, b *budget, what string) ([]byte, error) {
	var line []byte
	for {
		frag, err := br.ReadSlice('\n')
		n := len(line) + len(frag)
		if n > limit {
			return nil, protocolErrorf("%s longer than %d bytes", what, limit)
		}
		if b != nil && n > b.left {
			return nil, protocolErrorf("%s longer than %d bytes", b.of, b.max)
		}
		line = append(line, frag...)
		switch {
		case err == nil:
			if b != nil {
				b.left -= n
			}
			return line[:n-1], nil
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		case errors.Is(err, io.EOF) && n == 0:
			return nil, io.EOF
		case errors.Is(err, io.EOF):
			return nil, io.ErrUnexpectedEOF
		default:
			return nil, err
		}
	}
}

// bodyReader frames an answer's body (RFC 9112, section 6.3) in
// net/http's order: a malformed Transfer-Encoding or Content-Length is an
// error even where the status allows no body.
func bodyReader(br *bufio.Reader, http11 bool, status int, h header) (io.Reader, error) {
	chunked := false
	if te := h["transfer-encoding"]; len(te) > 0 && http11 {
		if len(te) != 1 || !strings.EqualFold(te[0], "chunked") {
			return nil, protocolErrorf("unsupported transfer encoding %q: sandboxd sends chunked bodies or lengths", truncate([]byte(strings.Join(te, ", "))))
		}
		chunked = true
	}
	n, err := parseContentLength(h["content-length"])
	if err != nil {
		return nil, err
	}
	switch {
	case status/100 == 1 || status == 204 || status == 304:
		return eofReader{}, nil
	case chunked:
		return &chunkedReader{br: br}, nil
	case n >= 0:
		return &lengthReader{r: br, n: n}, nil
	}
	// No length: the body ends with the connection.
	return br, nil
}

// parseContentLength reads the Content-Length fields, which must agree: -1
// when there is none.
func parseContentLength(values []string) (int64, error) {
	if len(values) == 0 {
		return -1, nil
	}
	v := values[0]
	for _, other := range values[1:] {
		if other != v {
			return 0, protocolErrorf("conflicting Content-Length values %q", truncate([]byte(strings.Join(values, ", "))))
		}
	}
	n, err := strconv.ParseUint(v, 10, 63)
	if err != nil {
		return 0, protocolErrorf("bad Content-Length %q", truncate([]byte(v)))
	}
	return int64(n), nil
}

// lengthReader is a body of n bytes.
type lengthReader struct {
	r io.Reader
	n int64
}

func (l *lengthReader) Read(p []byte) (int, error) {
	if l.n <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	n, err := l.r.Read(p)
	l.n -= int64(n)
	if errors.Is(err, io.EOF) && l.n > 0 {
		err = errBodyCut
	}
	if l.n == 0 && err == nil {
		err = io.EOF
	}
	return n, err
}

// chunkedReader decodes a chunked body (RFC 9112, section 7.1) as net/http
// does: hex sizes, extensions ignored, lines ending in CRLF, the trailer
// read and dropped.
type chunkedReader struct {
	br       *bufio.Reader
	left     int64 // bytes left in the current chunk
	inChunk  bool  // a chunk's data was read: its CRLF comes next
	overhead int64 // what the body carried beyond its data, less an allowance
	err      error // sticky: io.EOF at the end, or what broke
}

func (c *chunkedReader) Read(p []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	if len(p) == 0 {
		return 0, nil
	}
	if c.left == 0 {
		if err := c.next(); err != nil {
			c.err = err
			return 0, err
		}
		if c.left == 0 {
			c.err = io.EOF
			return 0, io.EOF
		}
	}
	if int64(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.br.Read(p)
	c.left -= int64(n)
	if err != nil {
		if errors.Is(err, io.EOF) {
			err = errBodyCut
		}
		c.err = err
	}
	return n, err
}

// next ends the chunk read and reads the next chunk's size; at the last
// chunk it reads the trailer and leaves left at 0.
func (c *chunkedReader) next() error {
	if c.inChunk {
		var end [2]byte
		if _, err := io.ReadFull(c.br, end[:]); err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
				err = errBodyCut
			}
			return err
		}
		if string(end[:]) != "\r\n" {
			return protocolErrorf("chunk data longer than its size, or not followed by CRLF")
		}
	}
	line, err := readLine(c.br, maxChunkLine, nil, "chunk size line")
	if err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			err = errBodyCut
		}
		return err
	}
	// readLine took the LF; the CR must be right before it, and only there.
	if len(line) == 0 || bytes.IndexByte(line, '\r') != len(line)-1 {
		return protocolErrorf("chunk size line %q does not end in CRLF", truncate(line))
	}
	line = line[:len(line)-1]
	// The overhead is counted as net/http counts it: the line, and the
	// CRLF after the chunk's data.
	c.overhead += int64(len(line)) + 2
	// Extensions are ignored.
	size, _, _ := bytes.Cut(bytes.TrimRight(line, " \t"), []byte(";"))
	n, err := parseHex(size)
	if err != nil {
		return protocolErrorf("bad chunk size line %q", truncate(line))
	}
	c.overhead = max(c.overhead-16-2*n, 0)
	if c.overhead > maxChunkOverhead {
		return protocolErrorf("the chunked body carries too much besides its data")
	}
	c.left, c.inChunk = n, true
	if n > 0 {
		return nil
	}
	if _, err := readHeader(c.br, newBudget(maxTrailerBytes, "trailer"), "trailer field"); err != nil {
		return err
	}
	return nil
}

// parseHex reads a chunk size: 1 to 16 hex digits, within int64.
func parseHex(b []byte) (int64, error) {
	if len(b) == 0 || len(b) > 16 {
		return 0, errors.New("bad chunk size")
	}
	var n uint64
	for _, c := range b {
		var d byte
		switch {
		case '0' <= c && c <= '9':
			d = c - '0'
		case 'a' <= c && c <= 'f':
			d = c - 'a' + 10
		case 'A' <= c && c <= 'F':
			d = c - 'A' + 10
		default:
			return 0, errors.New("bad chunk size")
		}
		n = n<<4 | uint64(d)
	}
	if n > 1<<63-1 {
		return 0, errors.New("chunk size out of range")
	}
	return int64(n), nil
}

type eofReader struct{}

func (eofReader) Read([]byte) (int, error) { return 0, io.EOF }

func isDigits(b []byte) bool {
	for _, c := range b {
		if c < '0' || c > '9' {
			return false
		}
	}
	return len(b) > 0
}

// isToken reports whether b is an HTTP token (a field name).
func isToken(b []byte) bool {
	for _, c := range b {
		if c <= ' ' || c >= 0x7f || strings.IndexByte(`"(),/:;<=>?@[\]{}`, c) >= 0 {
			return false
		}
	}
	return true
}

// truncate shortens what an error quotes of hostile input.
func truncate(b []byte) string {
	if len(b) > 80 {
		return string(b[:80]) + "..."
	}
	return string(b)
}

// statusText is the reason phrase of a status, as net/http's StatusText.
func statusText(code int) string {
	switch code {
	case 100:
		return "Continue"
	case 101:
		return "Switching Protocols"
	case 102:
		return "Processing"
	case 103:
		return "Early Hints"
	case 200:
		return "OK"
	case 201:
		return "Created"
	case 202:
		return "Accepted"
	case 203:
		return "Non-Authoritative Information"
	case 204:
		return "No Content"
	case 205:
		return "Reset Content"
	case 206:
		return "Partial Content"
	case 207:
		return "Multi-Status"
	case 208:
		return "Already Reported"
	case 226:
		return "IM Used"
	case 300:
		return "Multiple Choices"
	case 301:
		return "Moved Permanently"
	case 302:
		return "Found"
	case 303:
		return "See Other"
	case 304:
		return "Not Modified"
	case 305:
		return "Use Proxy"
	case 307:
		return "Temporary Redirect"
	case 308:
		return "Permanent Redirect"
	case 400:
		return "Bad Request"
	case 401:
		return "Unauthorized"
	case 402:
		return "Payment Required"
	case 403:
		return "Forbidden"
	case 404:
		return "Not Found"
	case 405:
		return "Method Not Allowed"
	case 406:
		return "Not Acceptable"
	case 407:
		return "Proxy Authentication Required"
	case 408:
		return "Request Timeout"
	case 409:
		return "Conflict"
	case 410:
		return "Gone"
	case 411:
		return "Length Required"
	case 412:
		return "Precondition Failed"
	case 413:
		return "Request Entity Too Large"
	case 414:
		return "Request URI Too Long"
	case 415:
		return "Unsupported Media Type"
	case 416:
		return "Requested Range Not Satisfiable"
	case 417:
		return "Expectation Failed"
	case 418:
		return "I'm a teapot"
	case 421:
		return "Misdirected Request"
	case 422:
		return "Unprocessable Entity"
	case 423:
		return "Locked"
	case 424:
		return "Failed Dependency"
	case 425:
		return "Too Early"
	case 426:
		return "Upgrade Required"
	case 428:
		return "Precondition Required"
	case 429:
		return "Too Many Requests"
	case 431:
		return "Request Header Fields Too Large"
	case 451:
		return "Unavailable For Legal Reasons"
	case 500:
		return "Internal Server Error"
	case 501:
		return "Not Implemented"
	case 502:
		return "Bad Gateway"
	case 503:
		return "Service Unavailable"
	case 504:
		return "Gateway Timeout"
	case 505:
		return "HTTP Version Not Supported"
	case 506:
		return "Variant Also Negotiates"
	case 507:
		return "Insufficient Storage"
	case 508:
		return "Loop Detected"
	case 510:
		return "Not Extended"
	case 511:
		return "Network Authentication Required"
	}
	return ""
}

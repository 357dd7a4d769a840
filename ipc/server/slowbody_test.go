package server_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/ipctest"
	"github.com/sandboxd/sandboxd/ipc/server"
)

const testBodyIdle = 300 * time.Millisecond

// sendSlowly writes an HTTP request whose body comes in pieces, with pause
// between them, and returns the response status (or the read error).
func sendSlowly(t *testing.T, sock, path string, declared int, pieces []string, pause time.Duration) (int, string, error) {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: sandboxd\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", path, declared)
	for _, p := range pieces {
		if _, err := io.WriteString(c, p); err != nil {
			break
		}
		time.Sleep(pause)
	}
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return 0, "", err
	}
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), nil
}

// TestSlowRequestBodiesTimeOut: a body that stops arriving ends with a 504
// after the idle timeout; a body that trickles in (each piece within the
// timeout, the whole far longer) is served; a handler that works long after
// reading its body is not cut.
func TestSlowRequestBodiesTimeOut(t *testing.T) {
	s := start(t, ipctest.Options{Server: server.Options{BodyIdleTimeout: testBodyIdle}})
	body := `{"cwd":"/work/repo"}`
	// Stalls after 5 bytes of 20: answered, with a timeout.
	code, msg, err := sendSlowly(t, s.Socket, "/v1/sessions/start", len(body), []string{body[:5]}, 0)
	if err != nil || code != http.StatusGatewayTimeout || !strings.Contains(msg, "stalled") {
		t.Fatalf("stalled body: %d %q %v", code, msg, err)
	}
	// Trickles in over ~4x the idle timeout.
	var pieces []string
	for i := 0; i < len(body); i += 5 {
		pieces = append(pieces, body[i:min(i+5, len(body))])
	}
	code, msg, err = sendSlowly(t, s.Socket, "/v1/sessions/start", len(body), pieces, testBodyIdle/3)
	if err != nil || code/100 != 2 {
		t.Fatalf("trickling body: %d %q %v", code, msg, err)
	}
	// A start that waits well past the idle timeout after its body.
	s.Sessions.StartFn = func(ctx context.Context, req ipc.StartRequest) (ipc.StartResponse, error) {
		select {
		case <-time.After(3 * testBodyIdle):
			return ipc.StartResponse{}, nil
		case <-ctx.Done():
			return ipc.StartResponse{}, ctx.Err()
		}
	}
	code, msg, err = sendSlowly(t, s.Socket, "/v1/sessions/start", len(body), []string{body}, 0)
	if err != nil || code/100 != 2 {
		t.Fatalf("long handler: %d %q %v", code, msg, err)
	}
}

// TestExecRequestLineTimesOutButStdinMayBeQuiet: the exec's request line
// must come within the idle timeout; the stdin that follows may be quiet
// far longer.
func TestExecRequestLineTimesOutButStdinMayBeQuiet(t *testing.T) {
	s := start(t, ipctest.Options{Server: server.Options{BodyIdleTimeout: testBodyIdle}})
	code, msg, err := sendSlowly(t, s.Socket, "/v1/exec", 100, []string{`{"cwd":"/work`}, 0)
	if err != nil || code != http.StatusGatewayTimeout {
		t.Fatalf("stalled exec request: %d %q %v", code, msg, err)
	}
	s.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		b, err := io.ReadAll(st.Stdin())
		if err != nil {
			return ipc.ExecResult{}, err
		}
		_, _ = st.Stdout().Write(b)
		return ipc.ExecResult{}, nil
	}
	line := `{"cwd":"/work/repo","argv":["cat"],"stdin":true}` + "\n"
	stdin := `{"stdin":"aGk="}` + "\n" + `{"stdinEof":true}` + "\n"
	code, msg, err = sendSlowly(t, s.Socket, "/v1/exec", len(line)+len(stdin), []string{line, stdin}, 3*testBodyIdle)
	if err != nil || code != http.StatusOK || !strings.Contains(msg, `"exit"`) {
		t.Fatalf("quiet stdin: %d %q %v", code, msg, err)
	}
}

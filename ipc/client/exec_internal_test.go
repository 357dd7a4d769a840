package client

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net/http/httputil"
	"testing"
)

// chunkedConn is Exec's streamed request body: each frame one chunk, and a
// clean end (Close, or the uplink's errUplinkDone) the last chunk, written
// once; an abandoned stream (stdin failed) gets no last chunk, so the daemon
// sees it broken, not complete.
func TestChunkedConnFramesAndEnds(t *testing.T) {
	for _, end := range []struct {
		name  string
		close func(*chunkedConn) error
		clean bool
	}{
		{"Close", (*chunkedConn).Close, true},
		{"uplink done", func(c *chunkedConn) error { return c.CloseWithError(errUplinkDone) }, true},
		{"abandoned", func(c *chunkedConn) error { return c.CloseWithError(errors.New("read stdin: EIO")) }, false},
	} {
		t.Run(end.name, func(t *testing.T) {
			var wire bytes.Buffer
			c := &chunkedConn{w: &wire}
			for _, f := range []string{"{\"argv\":[\"true\"]}\n", "", "{\"stdinEof\":true}\n"} {
				if n, err := c.Write([]byte(f)); err != nil || n != len(f) {
					t.Fatalf("write %q: %d %v", f, n, err)
				}
			}
			if err := end.close(c); err != nil {
				t.Fatal(err)
			}
			if err := c.Close(); err != nil { // a second end writes nothing
				t.Fatal(err)
			}
			if _, err := c.Write([]byte("late")); err == nil {
				t.Fatal("a write after the end succeeded")
			}
			body, err := io.ReadAll(httputil.NewChunkedReader(bufio.NewReader(bytes.NewReader(wire.Bytes()))))
			if string(body) != "{\"argv\":[\"true\"]}\n{\"stdinEof\":true}\n" {
				t.Fatalf("the chunks carry %q", body)
			}
			if clean := err == nil && bytes.HasSuffix(wire.Bytes(), []byte("\r\n0\r\n\r\n")); clean != end.clean {
				t.Fatalf("clean end %v (read error %v), want %v; wire %q", clean, err, end.clean, wire.Bytes())
			}
		})
	}
}

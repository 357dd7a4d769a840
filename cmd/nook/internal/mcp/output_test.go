package mcp

import (
	"bytes"
	"strings"
	"testing"
)

// TestCaptureKeepsHeadAndTail: whatever the write sizes, the kept output is
// the first and last bytes of the stream, with a note counting the rest.
func TestCaptureKeepsHeadAndTail(t *testing.T) {
	var stream bytes.Buffer
	for i := 0; i < 3000; i++ {
		stream.WriteString(strings.Repeat(string(rune('a'+i%26)), i%7+1))
		stream.WriteByte('\n')
	}
	all := stream.Bytes()
	for _, chunk := range []int{1, 3, 100, 511, 512, 4096, len(all)} {
		c := newCapture(1024)
		for p := all; len(p) > 0; {
			k := min(chunk, len(p))
			c.Write(p[:k])
			p = p[k:]
		}
		got := c.String()
		if !c.truncated() || !strings.HasPrefix(got, string(all[:512])) || !strings.HasSuffix(got, string(all[len(all)-512:])) {
			t.Fatalf("chunk %d: head/tail not kept:\n%q", chunk, got)
		}
		if !strings.Contains(got, "bytes omitted") {
			t.Fatalf("chunk %d: no note", chunk)
		}
	}
	c := newCapture(1024)
	c.Write([]byte("short\n"))
	if c.truncated() || c.String() != "short\n" {
		t.Fatalf("short output changed: %q", c.String())
	}
	c = newCapture(1024)
	c.Write(all[:1024])
	if c.truncated() || c.String() != string(all[:1024]) {
		t.Fatal("output of exactly the limit changed")
	}
}

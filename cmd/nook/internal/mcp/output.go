package mcp

import (
	"fmt"
	"strings"
)

// capture keeps at most limit bytes of a stream: the head and the tail,
// since the start of a command's output says what ran and the end says how
// it failed. It counts what it dropped so that the agent is told.
type capture struct {
	limit int
	head  []byte
	tail  []byte // a ring of the last limit-len(head) bytes, once head is full
	start int    // the ring's oldest byte
	total int64
}

func newCapture(limit int) *capture { return &capture{limit: limit} }

func (c *capture) Write(p []byte) (int, error) {
	n := len(p)
	c.total += int64(n)
	headMax := c.limit / 2
	if room := headMax - len(c.head); room > 0 {
		k := min(room, len(p))
		c.head = append(c.head, p[:k]...)
		p = p[k:]
	}
	tailMax := c.limit - headMax
	if tailMax <= 0 {
		return n, nil
	}
	for len(p) > 0 {
		if len(c.tail) < tailMax {
			k := min(tailMax-len(c.tail), len(p))
			c.tail = append(c.tail, p[:k]...)
			p = p[k:]
			continue
		}
		// The ring is full: overwrite from its oldest byte.
		if len(p) >= tailMax {
			p = p[len(p)-tailMax:]
		}
		k := copy(c.tail[c.start:], p)
		if k < len(p) {
			copy(c.tail, p[k:])
		}
		c.start = (c.start + len(p)) % tailMax
		p = nil
	}
	return n, nil
}

// truncated reports whether bytes were dropped.
func (c *capture) truncated() bool { return c.total > int64(c.limit) }

// String is the kept output, with a note where bytes were dropped.
func (c *capture) String() string {
	tail := append(append([]byte(nil), c.tail[c.start:]...), c.tail[:c.start]...)
	if !c.truncated() {
		return string(c.head) + string(tail)
	}
	dropped := c.total - int64(len(c.head)) - int64(len(tail))
	var b strings.Builder
	b.Write(c.head)
	fmt.Fprintf(&b, "\n[... %d bytes omitted: the output was %d bytes, over the %d-byte limit; redirect it to a file in the sandbox and read parts of it ...]\n", dropped, c.total, c.limit)
	b.Write(tail)
	return b.String()
}

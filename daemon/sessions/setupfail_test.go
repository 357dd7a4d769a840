package sessions

import (
	"strings"
	"testing"
)

// TestPrintableKeepsTheEndWithoutControlCharacters: a failed run's summary
// (its commands' output) is cut to its end and loses what would drive the
// reader's terminal, keeping newlines and tabs.
func TestPrintableKeepsTheEndWithoutControlCharacters(t *testing.T) {
	got := printableTail("start\x1b]0;title\x07\r\nline\tend\xff", 1000)
	if strings.ContainsAny(got, "\x1b\x07\r") || !strings.Contains(got, "\nline\tend") {
		t.Fatalf("printable: %q", got)
	}
	long := strings.Repeat("x", 100) + "é" + strings.Repeat("y", 10)
	if got := printableTail(long, 11); len(got) > 11+3 || !strings.HasSuffix(got, strings.Repeat("y", 10)) {
		t.Fatalf("bounded: %q", got)
	}
}

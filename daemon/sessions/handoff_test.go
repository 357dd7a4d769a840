package sessions

import (
	"io"
	"sync/atomic"
	"testing"
	"time"
)

// TestStdinHandoffGivesTheNextReaderWhatComesAfterTheSwitch: a reader
// waiting for the caller's stdin when its attach is replaced ends, and the
// bytes written next reach the new reader; the end is told once.
func TestStdinHandoffGivesTheNextReaderWhatComesAfterTheSwitch(t *testing.T) {
	pr, pw := io.Pipe()
	var told atomic.Int32
	h := newStdinHandoff(pr, func() { told.Add(1) })
	defer h.close()
	old := h.next()
	oldDone := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(old)
		oldDone <- b
	}()
	time.Sleep(50 * time.Millisecond)
	cur := h.next()
	select {
	case b := <-oldDone:
		if len(b) != 0 {
			t.Fatalf("the replaced reader took %q", b)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the replaced reader did not end within 5 s")
	}
	go func() { _, _ = io.WriteString(pw, "hello\n"); pw.Close() }()
	b, err := io.ReadAll(cur)
	if err != nil || string(b) != "hello\n" {
		t.Fatalf("the current reader got %q, %v", b, err)
	}
	if told.Load() != 1 {
		t.Errorf("the end was told %d times", told.Load())
	}
}

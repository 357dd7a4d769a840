package sessions

import (
	"encoding/binary"
	"io"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/daemon/sshpool"
)

// unframe decodes hold's stdin frames: the bytes, and whether the end
// frame came.
func unframe(t *testing.T, b []byte) (data string, ended bool) {
	t.Helper()
	for len(b) > 0 {
		if len(b) < frameHeader {
			t.Fatalf("a cut frame header: %q", b)
		}
		n := int(binary.BigEndian.Uint32(b))
		b = b[frameHeader:]
		if n == 0 {
			if len(b) != 0 {
				t.Fatalf("bytes after the end frame: %q", b)
			}
			return data, true
		}
		if n > len(b) {
			t.Fatalf("a frame of %d bytes with %d left", n, len(b))
		}
		data += string(b[:n])
		b = b[n:]
	}
	return data, false
}

// TestStdinHandoffGivesTheNextReaderWhatComesAfterTheSwitch: a reader
// waiting for the caller's stdin when its attach is replaced ends without
// the end frame, and the bytes written next reach the new reader, then
// the end frame.
func TestStdinHandoffGivesTheNextReaderWhatComesAfterTheSwitch(t *testing.T) {
	pr, pw := io.Pipe()
	h := newStdinHandoff(pr)
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
	if err != nil {
		t.Fatal(err)
	}
	if data, ended := unframe(t, b); data != "hello\n" || !ended {
		t.Fatalf("the current reader got %q (end frame: %v)", data, ended)
	}
}

// TestStdinHandoffFramesWhatDoesNotFitInOneRead: a chunk larger than the
// reader's buffer goes out in several frames, none lost.
func TestStdinHandoffFramesWhatDoesNotFitInOneRead(t *testing.T) {
	want := make([]byte, 10000)
	for i := range want {
		want[i] = byte('a' + i%26)
	}
	pr, pw := io.Pipe()
	h := newStdinHandoff(pr)
	defer h.close()
	r := h.next()
	go func() { _, _ = pw.Write(want); pw.Close() }()
	var got []byte
	buf := make([]byte, 100)
	for {
		n, err := r.Read(buf)
		got = append(got, buf[:n]...)
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if data, ended := unframe(t, got); data != string(want) || !ended {
		t.Fatalf("got %d bytes (end frame: %v), want %d", len(data), ended, len(want))
	}
}

// TestHeldSignalNamesOnlyASignalThatMatchesTheExitCode: the holder's word
// names the signal of a 128+n exit only when the name is one this daemon
// knows and its number is n; anything else leaves the exit code alone.
func TestHeldSignalNamesOnlyASignalThatMatchesTheExitCode(t *testing.T) {
	code := func(n int) *int { return &n }
	for _, c := range []struct {
		st   sshpool.ExitStatus
		hs   holdState
		want sshpool.ExitStatus
	}{
		{sshpool.ExitStatus{Code: 143}, holdState{Ended: true, ExitCode: code(143), Signal: "TERM"}, sshpool.ExitStatus{Code: 143, Signal: "TERM"}},
		{sshpool.ExitStatus{Code: 130}, holdState{Ended: true, ExitCode: code(130), Signal: "INT"}, sshpool.ExitStatus{Code: 130, Signal: "INT"}},
		{sshpool.ExitStatus{Code: 143}, holdState{Ended: true, ExitCode: code(143), Signal: "KILL"}, sshpool.ExitStatus{Code: 143}},
		{sshpool.ExitStatus{Code: 143}, holdState{Ended: true, ExitCode: code(137), Signal: "TERM"}, sshpool.ExitStatus{Code: 143}},
		{sshpool.ExitStatus{Code: 143}, holdState{Ended: true, ExitCode: code(143), Signal: "rm -rf"}, sshpool.ExitStatus{Code: 143}},
		{sshpool.ExitStatus{Code: 143}, holdState{Ended: false, Signal: "TERM"}, sshpool.ExitStatus{Code: 143}},
		{sshpool.ExitStatus{Code: 143}, holdState{Ended: true, Signal: "TERM"}, sshpool.ExitStatus{Code: 143}},
	} {
		if got := heldSignal(c.st, c.hs); got != c.want {
			t.Errorf("heldSignal(%+v, %+v) = %+v, want %+v", c.st, c.hs, got, c.want)
		}
	}
}

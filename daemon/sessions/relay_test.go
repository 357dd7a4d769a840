package sessions

import (
	"bytes"
	"encoding/binary"
	"errors"
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/sandboxhelper/hold"
)

// TestRelayReaderRefusesForgedAndOversizedFrames: the daemon's reader of
// the relay's frames takes the output and an end that names the exec with
// an exit code 0..255, and refuses, as a forged answer (the relay is then
// closed and the command not run again), a data frame past 32 KiB, an
// end past 1 KiB, an end of another exec, an exit code out of range, an
// unreadable end and a frame of another type.
func TestRelayReaderRefusesForgedAndOversizedFrames(t *testing.T) {
	const id = "0123456789abcdef0123456789abcdef"
	frame := hold.AppendFrame
	var out, errs bytes.Buffer
	good := frame(frame(frame(nil, hold.FrameOut, []byte("out")), hold.FrameErr, []byte("err")), hold.FrameEnd, []byte(`{"id":"`+id+`","exit_code":7}`))
	st, err := readRelay(bytes.NewReader(good), id, &out, &errs)
	if err != nil || st.Code != 7 || out.String() != "out" || errs.String() != "err" {
		t.Fatalf("a well-formed exec: %+v, %v, stdout %q, stderr %q", st, err, out.String(), errs.String())
	}
	oversized := func(typ byte, n int) []byte {
		b := []byte{typ, 0, 0, 0, 0}
		binary.BigEndian.PutUint32(b[1:], uint32(n))
		return append(b, make([]byte, n)...)
	}
	for name, b := range map[string][]byte{
		"a data frame past 32 KiB": oversized(hold.FrameOut, 32<<10+1),
		"a length of 4 GiB":        {hold.FrameErr, 0xff, 0xff, 0xff, 0xff},
		"an end past 1 KiB":        frame(nil, hold.FrameEnd, []byte(`{"id":"`+id+`","exit_code":0,"x":"`+strings.Repeat("a", 1<<10)+`"}`)),
		"an end of another exec":   frame(nil, hold.FrameEnd, []byte(`{"id":"ffffffffffffffffffffffffffffffff","exit_code":0}`)),
		"an end without an id":     frame(nil, hold.FrameEnd, []byte(`{"exit_code":0}`)),
		"an exit code of 256":      frame(nil, hold.FrameEnd, []byte(`{"id":"`+id+`","exit_code":256}`)),
		"a negative exit code":     frame(nil, hold.FrameEnd, []byte(`{"id":"`+id+`","exit_code":-1}`)),
		"an unreadable end":        frame(nil, hold.FrameEnd, []byte(`{"id":`)),
		"a frame of another type":  frame(nil, 'q', nil),
		"a request back":           frame(nil, hold.FrameRequest, []byte(`{}`)),
	} {
		_, err := readRelay(bytes.NewReader(append(frame(nil, hold.FrameOut, []byte("x")), b...)), id, &out, &errs)
		if !errors.Is(err, errRelayForged) {
			t.Errorf("%s: %v, want it refused as forged", name, err)
		}
	}
	// A channel that ends before the end is a lost relay, not a forged one.
	if _, err := readRelay(bytes.NewReader(frame(nil, hold.FrameOut, []byte("x"))), id, &out, &errs); err == nil || errors.Is(err, errRelayForged) {
		t.Errorf("a relay that ends before the end: %v, want a read error", err)
	}
}

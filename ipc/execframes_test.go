package ipc_test

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/ipc"
)

func frame(kind byte, payload string) []byte {
	return append(ipc.AppendFrameHead(nil, kind, len(payload)), payload...)
}

// Binary exec frames read back as written; a malformed or cut stream is an
// error saying so, and a head announcing more than the bound is refused
// before anything is read or allocated for it.
func TestFrameReaderReadsFramesAndRefusesMalformedOnes(t *testing.T) {
	var stream []byte
	stream = append(stream, frame(ipc.FrameControl, `{"type":"started"}`)...)
	stream = append(stream, frame(ipc.FrameStdout, "out\x00")...)
	stream = append(stream, frame(ipc.FrameStderr, "")...)
	fr := ipc.NewFrameReader(bytes.NewReader(stream))
	for _, want := range []struct {
		kind    byte
		payload string
	}{{ipc.FrameControl, `{"type":"started"}`}, {ipc.FrameStdout, "out\x00"}, {ipc.FrameStderr, ""}} {
		kind, payload, err := fr.Next()
		if err != nil || kind != want.kind || string(payload) != want.payload {
			t.Fatalf("frame %d %q %v, want %d %q", kind, payload, err, want.kind, want.payload)
		}
	}
	if _, _, err := fr.Next(); !errors.Is(err, io.EOF) {
		t.Fatalf("after the last frame: %v, want EOF", err)
	}

	for _, tc := range []struct {
		name   string
		stream []byte
		want   string
	}{
		{"unknown kind", frame(9, "x"), "unknown kind 9"},
		{"padding not zero", []byte{1, 0, 7, 0, 0, 0, 0, 1, 'x'}, "not zero"},
		{"too long", []byte{1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff}, "more than the 1048576 allowed"},
		{"cut in the head", []byte{1, 0, 0}, io.ErrUnexpectedEOF.Error()},
		{"cut in the payload", frame(ipc.FrameStdout, "abc")[:10], io.ErrUnexpectedEOF.Error()},
	} {
		_, _, err := ipc.NewFrameReader(bytes.NewReader(tc.stream)).Next()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error saying %q", tc.name, err, tc.want)
		}
	}
}

// FuzzFrameReader: whatever the stream, the reader returns frames within
// the bound or an error, never a panic.
func FuzzFrameReader(f *testing.F) {
	f.Add(append(frame(ipc.FrameControl, `{"type":"exit"}`), frame(ipc.FrameStdout, "x")...))
	f.Add([]byte{1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		fr := ipc.NewFrameReader(bytes.NewReader(b))
		for range len(b) + 1 {
			kind, payload, err := fr.Next()
			if err != nil {
				return
			}
			if kind < ipc.FrameStdout || kind > ipc.FrameControl || len(payload) > ipc.MaxFramePayload {
				t.Fatalf("frame of kind %d with %d bytes", kind, len(payload))
			}
		}
	})
}

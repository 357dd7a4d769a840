package helperproto

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
)

// Frames written are read back as written: control frames as JSON, data
// frames cut into chunks whose offsets count the bytes before them.
func TestFramesRoundTripWithOffsets(t *testing.T) {
	var b bytes.Buffer
	fw := &FrameWriter{W: &b}
	if err := fw.JSON(FrameExit, Exit{Code: 3}); err != nil {
		t.Fatal(err)
	}
	data := strings.Repeat("x", DataChunk+10)
	if err := fw.Data(FrameStdout, 5, []byte(data)); err != nil {
		t.Fatal(err)
	}
	fr := &FrameReader{R: &b}
	typ, p, err := fr.Next()
	var e Exit
	if err != nil || typ != FrameExit || Decode(typ, p, &e) != nil || e.Code != 3 {
		t.Fatalf("exit frame: %q %q %v", typ, p, err)
	}
	var got []byte
	want := int64(5)
	for range 2 {
		typ, p, err := fr.Next()
		if err != nil || typ != FrameStdout {
			t.Fatalf("data frame: %q %v", typ, err)
		}
		off, d, err := SplitData(p)
		if err != nil || off != want {
			t.Fatalf("offset %d, want %d (%v)", off, want, err)
		}
		want += int64(len(d))
		got = append(got, d...)
	}
	if string(got) != data {
		t.Fatalf("data of %d bytes, want %d", len(got), len(data))
	}
	if _, _, err := fr.Next(); !errors.Is(err, io.EOF) {
		t.Fatalf("after the last frame: %v", err)
	}
}

// A frame whose length is over its bound is refused before anything of it
// is read or allocated; so is a stream cut inside a frame.
func TestFrameReaderRefusesWhatBreaksItsBounds(t *testing.T) {
	over := []byte{FrameStdout, 0x00, 0x10, 0x00, 0x01} // MaxFrame + 1
	if _, _, err := (&FrameReader{R: bytes.NewReader(over)}).Next(); !errors.Is(err, ErrFrame) {
		t.Fatalf("a frame over MaxFrame: %v", err)
	}
	cut := []byte{FrameExit, 0, 0, 0, 10, '{'}
	if _, _, err := (&FrameReader{R: bytes.NewReader(cut)}).Next(); !errors.Is(err, ErrFrame) {
		t.Fatalf("a cut frame: %v", err)
	}
	if _, _, err := (&FrameReader{R: bytes.NewReader([]byte{FrameExit, 0})}).Next(); !errors.Is(err, ErrFrame) {
		t.Fatalf("a cut header: %v", err)
	}
	if _, _, err := SplitData([]byte{1, 2}); !errors.Is(err, ErrFrame) {
		t.Fatalf("a data frame without its offset: %v", err)
	}
}

// The answer's control frames together stay within the reader's budget;
// the command's output does not count against it.
func TestFrameReaderBoundsTheControlFramesTogether(t *testing.T) {
	var b bytes.Buffer
	fw := &FrameWriter{W: &b}
	for range 4 {
		_ = fw.Data(FrameStdout, 0, bytes.Repeat([]byte("o"), 100))
	}
	for range 4 {
		_ = fw.Write(FramePull, bytes.Repeat([]byte("p"), 100))
	}
	fr := &FrameReader{R: &b, Budget: 250}
	var err error
	n := 0
	for err == nil {
		_, _, err = fr.Next()
		n++
	}
	if !errors.Is(err, ErrFrame) || n != 7 {
		t.Fatalf("after %d frames: %v, want the budget's error at the third pull frame", n, err)
	}
}

// Frames written under a key are read back under it; a frame without the
// tag, one under another key, and a stream that lost a frame are refused.
func TestTaggedFramesAreTakenOnlyWithTheirTag(t *testing.T) {
	key := AnswerKey(bytes.Repeat([]byte{1}, NonceSize), []byte(`{"command":"true"}`))
	write := func(key []byte, frames ...byte) []byte {
		var b bytes.Buffer
		fw := &FrameWriter{W: &b, Key: key}
		for _, typ := range frames {
			if err := fw.JSON(typ, Exit{Code: int(typ)}); err != nil {
				t.Fatal(err)
			}
		}
		return b.Bytes()
	}
	fr := &FrameReader{R: bytes.NewReader(write(key, FrameHelloAnswer, FrameExit)), Key: key}
	for _, want := range []byte{FrameHelloAnswer, FrameExit} {
		typ, p, err := fr.Next()
		var e Exit
		if err != nil || typ != want || Decode(typ, p, &e) != nil || e.Code != int(want) {
			t.Fatalf("frame %q: %q %q %v", want, typ, p, err)
		}
	}
	other := AnswerKey(bytes.Repeat([]byte{1}, NonceSize), []byte(`{"command":"false"}`))
	whole := write(key, FrameHelloAnswer, FrameExit)
	cases := map[string][]byte{
		"untagged":           write(nil, FrameHelloAnswer),
		"another request":    write(other, FrameHelloAnswer),
		"a frame left out":   whole[len(write(key, FrameHelloAnswer)):],
		"shorter than a tag": {FrameEnd, 0, 0, 0, 1, 0},
	}
	for name, stream := range cases {
		if _, _, err := (&FrameReader{R: bytes.NewReader(stream), Key: key}).Next(); !errors.Is(err, ErrFrame) {
			t.Errorf("%s: %v, want ErrFrame", name, err)
		}
	}
}

// BenchmarkAnswerStream writes and reads 32 KiB data frames, tagged or not:
// the cost the tags add to a command's output.
func BenchmarkAnswerStream(b *testing.B) {
	chunk := bytes.Repeat([]byte("x"), DataChunk)
	for _, keyed := range []bool{false, true} {
		b.Run(map[bool]string{false: "untagged", true: "tagged"}[keyed], func(b *testing.B) {
			var key []byte
			if keyed {
				key = AnswerKey(make([]byte, NonceSize), nil)
			}
			var buf bytes.Buffer
			fw := &FrameWriter{W: &buf, Key: key}
			fr := &FrameReader{R: &buf, Key: key}
			b.SetBytes(DataChunk)
			for i := 0; i < b.N; i++ {
				if err := fw.Data(FrameStdout, int64(i)*DataChunk, chunk); err != nil {
					b.Fatal(err)
				}
				if _, _, err := fr.Next(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// A Patch frame may carry what a request may (the patch of an early
// request), up to MaxRequest and not beyond.
func TestPatchFrameIsBoundedAsTheRequest(t *testing.T) {
	var b bytes.Buffer
	payload := bytes.Repeat([]byte{'p'}, MaxFrame+1)
	if err := (&FrameWriter{W: &b}).Write(FramePatch, payload); err != nil {
		t.Fatal(err)
	}
	typ, p, err := (&FrameReader{R: &b}).Next()
	if err != nil || typ != FramePatch || !bytes.Equal(p, payload) {
		t.Fatalf("a Patch frame over MaxFrame: %q, %d bytes, %v", typ, len(p), err)
	}
	over := []byte{FramePatch, 0x0a, 0x00, 0x00, 0x01} // MaxRequest + 1
	if _, _, err := (&FrameReader{R: bytes.NewReader(over)}).Next(); !errors.Is(err, ErrFrame) {
		t.Fatalf("a Patch frame over MaxRequest: %v", err)
	}
}

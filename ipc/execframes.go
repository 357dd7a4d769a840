package ipc

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// An exec's answer comes as NDJSON unless the request carries
// HeaderExecFrames: ExecFramesBinary. The daemon then answers with
// ContentTypeExecFrames: frames of an 8-byte head (a kind byte, three zero
// bytes, the payload's length as a big-endian uint32, as moby's stdcopy)
// and the payload. Stdout and stderr frames carry the output's bytes as
// they are; a control frame carries one ExecOutput as JSON (queued,
// started, warning, exit, error). curl and the Neovim plugin send no such
// header and keep reading NDJSON.
const (
	HeaderExecFrames      = "Sandboxd-Exec-Frames"
	ExecFramesBinary      = "binary"
	ContentTypeExecFrames = "application/vnd.sandboxd.exec-frames"
)

// Kinds of binary exec frames.
const (
	FrameStdout  byte = 1
	FrameStderr  byte = 2
	FrameControl byte = 3
)

// FrameHeadLen is the length of a binary frame's head.
const FrameHeadLen = 8

// MaxFramePayload bounds a binary frame's payload: the daemon splits
// longer output, and a reader refuses a longer frame.
const MaxFramePayload = 1 << 20

// AppendFrameHead appends the head of a frame of kind with n bytes of
// payload (n <= MaxFramePayload).
func AppendFrameHead(b []byte, kind byte, n int) []byte {
	b = append(b, kind, 0, 0, 0)
	return binary.BigEndian.AppendUint32(b, uint32(n))
}

// FrameReader reads binary exec frames.
type FrameReader struct {
	r    *bufio.Reader
	head [FrameHeadLen]byte
	buf  []byte
}

// NewFrameReader reads frames from r.
func NewFrameReader(r io.Reader) *FrameReader {
	return &FrameReader{r: bufio.NewReaderSize(r, 64<<10)}
}

// ErrFrame says a binary frame is malformed.
var ErrFrame = errors.New("malformed exec frame")

// Next returns the next frame's kind and payload; the payload is valid
// until the next call. io.EOF means the stream ended between frames;
// io.ErrUnexpectedEOF that it ended within one.
func (fr *FrameReader) Next() (kind byte, payload []byte, err error) {
	if _, err := io.ReadFull(fr.r, fr.head[:]); err != nil {
		return 0, nil, err
	}
	kind = fr.head[0]
	n := binary.BigEndian.Uint32(fr.head[4:])
	switch {
	case kind < FrameStdout || kind > FrameControl:
		return 0, nil, fmt.Errorf("%w: unknown kind %d", ErrFrame, kind)
	case fr.head[1] != 0 || fr.head[2] != 0 || fr.head[3] != 0:
		return 0, nil, fmt.Errorf("%w: bytes 1 to 3 of the head are not zero", ErrFrame)
	case n > MaxFramePayload:
		return 0, nil, fmt.Errorf("%w: a payload of %d bytes, more than the %d allowed", ErrFrame, n, MaxFramePayload)
	}
	if cap(fr.buf) < int(n) {
		fr.buf = make([]byte, n)
	}
	fr.buf = fr.buf[:n]
	if _, err := io.ReadFull(fr.r, fr.buf); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return 0, nil, err
	}
	return kind, fr.buf, nil
}

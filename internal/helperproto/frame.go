package helperproto

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
)

// The exchange protocol (`sandboxd-helper exchange`): push, the user's
// command and pull in one exec request whose stdin carries the daemon's
// frames and whose stdout carries the helper's. A frame is
//
//	[type: 1 byte][length: 4 bytes, big endian][payload: length bytes]
//
// Control payloads are JSON; data payloads are an 8-byte offset (big
// endian, the count of the stream's bytes before this frame) then the
// bytes. The user's command never writes to the channel: the helper starts
// it with pipes of its own and frames what it reads from them, so nothing
// the command prints can be taken for a frame, and nothing depends on a
// secret the command could read.
//
// The daemon writes Hello, then Request, then Stdin frames, StdinEOF and
// Signal frames as they come. The helper answers Hello, then either
// Declined, or Pull frames and PushFailed (nothing ran), or Started, Stdout/Stderr frames,
// Exit, Pull frames, PullEnd; End closes every answer that completed.
const (
	// Daemon to helper.
	FrameHello    byte = 'H' // Hello
	FrameRequest  byte = 'R' // ExchangeRequest
	FrameStdin    byte = 'I' // data: the caller's stdin
	FrameStdinEOF byte = 'i' // empty: the caller's stdin ended
	FrameSignal   byte = 'S' // Signal

	// Helper to daemon.
	FrameHelloAnswer byte = 'h' // HelloAnswer
	FrameDeclined    byte = 'D' // Declined: nothing changed, nothing ran
	FramePushFailed  byte = 'P' // PushFailed: nothing ran
	FrameStarted     byte = 'G' // Started: the command is about to start
	FrameStdout      byte = 'O' // data: the command's stdout
	FrameStderr      byte = 'E' // data: the command's stderr
	FrameExit        byte = 'X' // Exit
	FramePull        byte = 'L' // raw: the pull's (or failed push's) output
	FramePullEnd     byte = 'l' // PullEnd
	FrameEnd         byte = 'Z' // empty: the exchange is complete
)

// Version is the exchange protocol this package speaks. A helper that
// speaks none of the daemon's versions answers HelloAnswer{Version: 0}
// and nothing else; the daemon then takes the shell way.
const Version = 1

// MaxFrame bounds one frame's payload, except FrameRequest's (MaxRequest).
const MaxFrame = 1 << 20

// MaxRequest bounds the request frame, which carries the push's patch.
const MaxRequest = 160 << 20

// DataChunk is the most a data frame carries.
const DataChunk = 32 << 10

// Hello states the versions the daemon speaks.
type Hello struct {
	Versions []int `json:"versions"`
}

// HelloAnswer is the version the helper chose; 0 for none.
type HelloAnswer struct {
	Version int `json:"version"`
}

// ExchangeRequest is one synced exec. Entries (the native push) and Patch
// (the plain push, run by PushScript with the patch on its stdin) may be
// both present: the helper takes the plain way when the native one
// declines.
type ExchangeRequest struct {
	// Instance is the helper server to ask for the native push and pull.
	Instance string `json:"instance"`
	Head     string `json:"head"`
	Time     int64  `json:"time"`
	SnapRef  string `json:"snap_ref"`
	BaseRef  string `json:"base_ref"`
	// Pending is the exec's id, marked pending once the push is done.
	Pending string `json:"pending"`
	// Acks are the exec ids whose edits the daemon acknowledged: an
	// unacknowledged pending id makes the helper take the plain push,
	// which brings those edits back first.
	Acks    []string        `json:"acks"`
	Entries json.RawMessage `json:"entries,omitempty"`
	Patch   []byte          `json:"patch,omitempty"`
	// PushScript and PullScript are the shell ways of the push and the
	// pull, run by /bin/sh -c when the native ones decline.
	PushScript string `json:"push_script"`
	PullScript string `json:"pull_script"`
	// Max bounds the pull's patch (the header alone above it).
	Max      int64    `json:"max"`
	DiffArgs []string `json:"diff_args"`
	// Command is the user's command line for /bin/sh -c; Path its PATH.
	Command string `json:"command"`
	Path    string `json:"path"`
}

// Declined says the helper changed nothing and did not start the command.
type Declined struct {
	Reason string `json:"reason"`
}

// PushFailed is the plain push's failure: its exit code (the push
// script's own, see daemon/gitsync) and its messages. Its output (the
// edits of an earlier exec it brings back, in the pull's format) comes
// before it, in FramePull frames.
type PushFailed struct {
	Code   int    `json:"code"`
	Stderr string `json:"stderr"`
}

// Started says the push is done and the command is about to start.
type Started struct {
	Snapshot string `json:"snapshot"`
	// Native: the helper knows the working tree, so the pull is native.
	Native bool `json:"native"`
}

// Exit is how the command ended: Code, or Signal (a name such as "TERM").
type Exit struct {
	Code   int    `json:"code"`
	Signal string `json:"signal,omitempty"`
}

// PullEnd ends the pull's output: the pull's exit code (the pull
// script's, or ExitPullTooLarge) and its messages.
type PullEnd struct {
	Code   int    `json:"code"`
	Stderr string `json:"stderr"`
}

// Signal is a signal for the command's process group, by name.
type Signal struct {
	Name string `json:"name"`
}

// signalName is what a Signal or Exit may name.
var signalName = regexp.MustCompile(`^[A-Z][A-Z0-9]{0,9}$`)

// ValidSignal says name may be a signal's name.
func ValidSignal(name string) bool { return signalName.MatchString(name) }

// ErrFrame reports a frame that breaks the protocol.
var ErrFrame = errors.New("malformed exchange frame")

// FrameWriter writes frames; it is not safe for concurrent use.
type FrameWriter struct {
	W   io.Writer
	buf []byte
}

// Write writes one frame.
func (f *FrameWriter) Write(typ byte, payload []byte) error {
	f.buf = append(f.buf[:0], typ, 0, 0, 0, 0)
	binary.BigEndian.PutUint32(f.buf[1:5], uint32(len(payload)))
	f.buf = append(f.buf, payload...)
	_, err := f.W.Write(f.buf)
	return err
}

// JSON writes one frame whose payload is v's JSON.
func (f *FrameWriter) JSON(typ byte, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return f.Write(typ, b)
}

// Data writes p as data frames of at most DataChunk bytes from offset off.
func (f *FrameWriter) Data(typ byte, off int64, p []byte) error {
	for len(p) > 0 {
		n := min(len(p), DataChunk)
		f.buf = append(f.buf[:0], typ, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
		binary.BigEndian.PutUint32(f.buf[1:5], uint32(8+n))
		binary.BigEndian.PutUint64(f.buf[5:13], uint64(off))
		f.buf = append(f.buf, p[:n]...)
		if _, err := f.W.Write(f.buf); err != nil {
			return err
		}
		p, off = p[n:], off+int64(n)
	}
	return nil
}

// FrameReader reads frames, each bounded by MaxFrame (MaxRequest for a
// request frame) and all of them together by Budget, when set.
type FrameReader struct {
	R io.Reader
	// Budget, when positive, bounds the payload bytes of every frame but
	// data frames (FrameStdout, FrameStderr, FrameStdin) together: the
	// rest of an answer is the sandbox's word, and its size is bounded.
	Budget int64
	used   int64
	hdr    [5]byte
}

// Next reads one frame. io.EOF means the stream ended between frames.
func (f *FrameReader) Next() (typ byte, payload []byte, err error) {
	if _, err := io.ReadFull(f.R, f.hdr[:]); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return 0, nil, fmt.Errorf("%w: the stream ended inside a frame header", ErrFrame)
		}
		return 0, nil, err
	}
	typ = f.hdr[0]
	n := int64(binary.BigEndian.Uint32(f.hdr[1:]))
	limit := int64(MaxFrame)
	if typ == FrameRequest {
		limit = MaxRequest
	}
	if n > limit {
		return typ, nil, fmt.Errorf("%w: frame %q of %d bytes, over the %d allowed", ErrFrame, typ, n, limit)
	}
	data := typ == FrameStdout || typ == FrameStderr || typ == FrameStdin
	if !data && f.Budget > 0 {
		if f.used+n > f.Budget {
			return typ, nil, fmt.Errorf("%w: the answer's frames exceed %d bytes", ErrFrame, f.Budget)
		}
		f.used += n
	}
	payload = make([]byte, n)
	if _, err := io.ReadFull(f.R, payload); err != nil {
		return typ, nil, fmt.Errorf("%w: the stream ended inside frame %q: %v", ErrFrame, typ, err)
	}
	return typ, payload, nil
}

// SplitData splits a data frame's payload into its offset and bytes.
func SplitData(payload []byte) (off int64, data []byte, err error) {
	if len(payload) < 8 {
		return 0, nil, fmt.Errorf("%w: a data frame of %d bytes has no offset", ErrFrame, len(payload))
	}
	o := binary.BigEndian.Uint64(payload[:8])
	if o > 1<<62 {
		return 0, nil, fmt.Errorf("%w: offset %d", ErrFrame, o)
	}
	return int64(o), payload[8:], nil
}

// Decode decodes a control frame's JSON payload into v.
func Decode(typ byte, payload []byte, v any) error {
	if err := json.Unmarshal(payload, v); err != nil {
		return fmt.Errorf("%w: frame %q: %v", ErrFrame, typ, err)
	}
	return nil
}

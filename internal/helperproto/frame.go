package helperproto

import (
	"crypto/hmac"
	"crypto/sha256"
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
// the command prints can be taken for a frame.
//
// Every frame the helper writes ends with a tag of TagSize bytes (counted
// in the length): HMAC-SHA256 under AnswerKey, the hello's nonce bound to
// the request the helper read, over the frame's sequence number, type and
// payload. A process that writes into the channel (it opened
// /proc/<pid>/fd/1 before the helper made itself non-dumpable, and may
// hold it open) without reading the daemon's stream cannot make a frame
// the daemon takes. The tag is the frame layer, the same in every
// version; versions name the messages.
//
// The daemon writes Hello, then Request, then (when the request says
// PatchFollows) one Patch frame, then Stdin frames, StdinEOF and Signal
// frames as they come. A request with PatchFollows goes out before the
// daemon's git computed the patch: its Entries are the native push's, and
// the helper reads the Patch frame only when it takes the plain push; a
// helper that pushed natively skips it as it skips any frame it does not
// read (it is never stdin). The helper answers Hello, then either
// Declined, or Pull frames and PushFailed (nothing ran), or Started, Stdout/Stderr frames,
// Exit, Pull frames, PullEnd; End closes every answer that completed.
//
// A request that names a hold id (ExchangeRequest.Hold) has its command
// run under the sandbox helper's holder (sandboxhelper/hold), which keeps
// it, its output and its status apart from the channel. When the
// connection is lost after Started and before Exit, the daemon opens a new
// exchange and writes Hello, then Reattach (instead of Request), then
// Stdin and Signal frames: the helper answers Hello, then the rest of the
// output from the offsets given, Exit, the pull and End, as after an
// unbroken exchange; or Declined when it knows no command of that id (the
// daemon then never starts it again).
const (
	// Daemon to helper.
	FrameHello    byte = 'H' // Hello
	FrameRequest  byte = 'R' // ExchangeRequest
	FrameReattach byte = 'A' // Reattach
	FramePatch    byte = 'T' // Patch: the plain push's patch, after Request
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

// Version is the exchange protocol this package speaks (2: tagged
// answers, the held command and Reattach, the helper's own sync steps). A helper that
// speaks none of the daemon's versions answers HelloAnswer{Version: 0}
// (tagged) and nothing else; the daemon then takes the shell way (whose
// command is held by `hold start`).
const Version = 2

// NonceSize is the size of Hello.Nonce; TagSize of the tag that ends
// every frame of the helper.
const (
	NonceSize = 32
	TagSize   = 16
)

// MaxFrame bounds one frame's payload, except FrameRequest's and
// FramePatch's (MaxRequest).
const MaxFrame = 1 << 20

// MaxRequest bounds the request frame and the patch frame, each of which
// may carry the push's patch.
const MaxRequest = 160 << 20

// DataChunk is the most a data frame carries.
const DataChunk = 32 << 10

// Hello states the versions the daemon speaks, and the fresh secret of
// this exchange's answer key (AnswerKey).
type Hello struct {
	Versions []int  `json:"versions"`
	Nonce    []byte `json:"nonce"`
}

// AnswerKey is the key of the tags of the helper's frames: the hello's
// nonce bound to the request frame's payload as the helper read it, so
// that answers to a request the daemon did not send are not taken either.
func AnswerKey(nonce, request []byte) []byte {
	sum := sha256.Sum256(request)
	m := hmac.New(sha256.New, nonce)
	m.Write([]byte("sandboxd exchange answers\x00"))
	m.Write(sum[:])
	return m.Sum(nil)
}

// HelloAnswer is the version the helper chose; 0 for none.
type HelloAnswer struct {
	Version int `json:"version"`
}

// ExchangeRequest is one synced exec. Entries (the native push) and Patch
// (the plain push, run by PushScript with the patch on its stdin) may be
// both present: the helper takes the plain way when the native one
// declines. With PatchFollows, Patch and PushScript are empty and come in
// the Patch frame that follows the request.
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
	// PatchFollows: a Patch frame follows the request (Patch).
	PatchFollows bool `json:"patch_follows,omitempty"`
	// StrayScript, PushScript and PullScript are the shell ways of the
	// look for edits made outside an exec, the push and the pull, run by
	// /bin/sh -c when the native ones decline. The helper hands them what
	// it found in their environment (see daemon/gitsync): StrayScript
	// gets x, c1 and sready and prints sready ("-" for none) on its last
	// line; PushScript gets sready and hcur (the tree the helper
	// staged, the user's index reset to head) and prints the snapshot and
	// the tree it made; PullScript gets hstaged (the sync index is
	// staged) and writes the patch to .git/sandboxd/pull.patch, which the
	// helper sends. A script's exit status is its step's: PushFailed's or
	// PullEnd's Code.
	StrayScript string `json:"stray_script"`
	PushScript  string `json:"push_script"`
	PullScript  string `json:"pull_script"`
	// Max bounds the pull's patch (the header alone above it).
	Max      int64    `json:"max"`
	DiffArgs []string `json:"diff_args"`
	// Command is the user's command line for /bin/sh -c; Path its PATH.
	Command string `json:"command"`
	Path    string `json:"path"`
	// Hold, when set, is the exec id (16 to 64 lowercase hex digits, the
	// daemon's) under which the holder runs the command once.
	Hold string `json:"hold,omitempty"`
	// Forget are the ids of earlier held exchanges whose exit the daemon
	// received: the holder removes what it kept of them (MaxForget).
	Forget []string `json:"forget,omitempty"`
}

// Patch is the plain push's patch and script, sent after a request that
// went out before the daemon's git computed them (PatchFollows). Error,
// when set, says the daemon could not compute them: a helper that needs
// them fails the push (nothing runs), and the daemon prepares again.
type Patch struct {
	Patch      []byte `json:"patch,omitempty"`
	PushScript string `json:"push_script,omitempty"`
	Error      string `json:"error,omitempty"`
}

// MaxForget bounds ExchangeRequest.Forget.
const MaxForget = 64

// Reattach asks for the rest of a held exchange whose connection was
// lost: the output of the command of Hold past the Out and Err bytes the
// daemon received, its exit, then the pull as Request's fields (Instance,
// Pending, Max, DiffArgs, PullScript) and Tree (Started's) ask for it.
type Reattach struct {
	Hold    string          `json:"hold"`
	Out     int64           `json:"out"`
	Err     int64           `json:"err"`
	Tree    string          `json:"tree,omitempty"`
	Request ExchangeRequest `json:"request"`
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
	// Tree is the tree the push left, the native pull's base, which a
	// Reattach hands back.
	Tree string `json:"tree,omitempty"`
}

// Exit is how the command ended: Code, or Signal (a name such as "TERM").
type Exit struct {
	Code   int    `json:"code"`
	Signal string `json:"signal,omitempty"`
}

// PullEnd ends the pull's output. TooLarge: the patch is over the
// request's Max, so its header alone was sent. Code: the pull script
// failed with that status (one of daemon/gitsync's, naming the step), and
// Stderr are its messages; nothing was sent.
type PullEnd struct {
	Code     int    `json:"code"`
	Stderr   string `json:"stderr"`
	TooLarge bool   `json:"too_large,omitempty"`
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

// ErrTruncated is the stream's end inside a frame: a lost connection, or
// a helper that broke off.
var ErrTruncated = fmt.Errorf("%w: the stream ended inside a frame", ErrFrame)

// FrameWriter writes frames; it is not safe for concurrent use.
type FrameWriter struct {
	W io.Writer
	// Key, when set, tags every frame (the helper's answers).
	Key []byte
	seq uint64
	buf []byte
}

// Write writes one frame.
func (f *FrameWriter) Write(typ byte, payload []byte) error {
	f.buf = append(f.buf[:0], typ, 0, 0, 0, 0)
	f.buf = append(f.buf, payload...)
	return f.flush()
}

// flush writes the frame in buf (type, room for the length, payload),
// tagged when the writer has a key.
func (f *FrameWriter) flush() error {
	if f.Key != nil {
		f.buf = append(f.buf, tag(f.Key, f.seq, f.buf[0], f.buf[5:])...)
		f.seq++
	}
	binary.BigEndian.PutUint32(f.buf[1:5], uint32(len(f.buf)-5))
	_, err := f.W.Write(f.buf)
	return err
}

// tag is the tag of the seq'th frame of a stream: its type and payload
// under key, so that a frame is neither forged, moved nor left out
// unnoticed.
func tag(key []byte, seq uint64, typ byte, payload []byte) []byte {
	m := hmac.New(sha256.New, key)
	var h [9]byte
	binary.BigEndian.PutUint64(h[:8], seq)
	h[8] = typ
	m.Write(h[:])
	m.Write(payload)
	return m.Sum(nil)[:TagSize]
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
		binary.BigEndian.PutUint64(f.buf[5:13], uint64(off))
		f.buf = append(f.buf, p[:n]...)
		if err := f.flush(); err != nil {
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
	// Key, when set, is the key of the tag every frame must end with
	// (AnswerKey); a frame without it is refused.
	Key  []byte
	seq  uint64
	used int64
	hdr  [5]byte
}

// Next reads one frame. io.EOF means the stream ended between frames.
func (f *FrameReader) Next() (typ byte, payload []byte, err error) {
	if _, err := io.ReadFull(f.R, f.hdr[:]); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return 0, nil, fmt.Errorf("%w header", ErrTruncated)
		}
		return 0, nil, err
	}
	typ = f.hdr[0]
	n := int64(binary.BigEndian.Uint32(f.hdr[1:]))
	limit := int64(MaxFrame)
	if typ == FrameRequest || typ == FramePatch {
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
		return typ, nil, fmt.Errorf("%w %q: %v", ErrTruncated, typ, err)
	}
	if f.Key != nil {
		if n < TagSize {
			return typ, nil, fmt.Errorf("%w: frame %q of %d bytes has no tag: it is not the helper's", ErrFrame, typ, n)
		}
		payload, t := payload[:n-TagSize], payload[n-TagSize:]
		if !hmac.Equal(t, tag(f.Key, f.seq, typ, payload)) {
			return typ, nil, fmt.Errorf("%w: frame %q does not carry the helper's tag (another process wrote into the channel, or a frame was lost)", ErrFrame, typ)
		}
		f.seq++
		return typ, payload, nil
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

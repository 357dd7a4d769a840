package helperproto

import (
	"encoding/binary"
	"fmt"
	"io"
)

// The hold stream: the frames of a held exec's output and end, from the
// helper's server to `hold start` and from the relay (`hold relay`, one
// long-lived channel per kept connection) to the daemon; and of its stdin
// the other way. A frame is a type byte, a 4-byte big-endian length and
// the payload. The relay's request and end are JSON.
const (
	HoldOut     = 'o' // the command's stdout bytes, already kept
	HoldErr     = 'e' // its stderr bytes, already kept
	HoldEnd     = 'x' // its end: a status (server) or RelayEnd (relay)
	HoldIn      = 'i' // stdin bytes
	HoldInEnd   = 'z' // the caller's stdin ended
	HoldRequest = 'r' // daemon → relay: RelayRequest
	HoldReady   = 'y' // relay → daemon, first: it serves (empty)
)

// Bounds of the hold stream's frames: a data frame, an end, a request.
const (
	MaxHoldFrame   = 32 << 10
	MaxHoldEnd     = 1 << 10
	MaxHoldRequest = 1 << 20
)

// RelayRequest asks the relay to start and relay one held exec. Env is
// added to the relay's own environment (what `hold start` would have
// passed), Dir replaces its working directory when set.
type RelayRequest struct {
	ID   string   `json:"id"`
	Argv []string `json:"argv"`
	Env  []string `json:"env,omitempty"`
	Dir  string   `json:"dir,omitempty"`
	// Forget are ids of earlier execs on this relay whose end the daemon
	// read: the holder removes what it kept of them (at most MaxForget).
	Forget []string `json:"forget,omitempty"`
	// Exchange asks for a synced exec's exchange (the `exchange` verb,
	// this package's frames) in the relay's own process instead of a
	// command: the 'i' frames carry the daemon's exchange frames, 'o' the
	// helper's, 'e' its messages, and the end the verb's exit code. Argv,
	// Env and Dir are unused.
	Exchange bool `json:"exchange,omitempty"`
	// Setup is the shell an exchange's exec request would run before the
	// helper (it finds git and the repository, and brings in the files
	// setup steps made). The relay runs it only when the checkout's .git
	// is not a directory, or none of SetupDone (paths under it) exists:
	// otherwise it has nothing to do.
	Setup     string   `json:"setup,omitempty"`
	SetupDone []string `json:"setup_done,omitempty"`
}

// RelayEnd is the end of one held exec: its exit code as `hold start`'s
// would be (a signal as 128+n, the holder's own codes with the reason on
// stderr).
type RelayEnd struct {
	ID       string `json:"id"`
	ExitCode int    `json:"exit_code"`
}

// AppendHoldFrame appends one frame of type typ to b.
func AppendHoldFrame(b []byte, typ byte, p []byte) []byte {
	b = append(b, typ)
	b = binary.BigEndian.AppendUint32(b, uint32(len(p)))
	return append(b, p...)
}

// HoldFrameSizeError is a frame whose length is past the bound.
type HoldFrameSizeError struct{ Size, Max int }

func (e *HoldFrameSizeError) Error() string {
	return fmt.Sprintf("a stream frame of %d bytes is past the bound of %d", e.Size, e.Max)
}

// ReadHoldFrame reads one frame whose payload is at most max bytes, into
// buf when it fits.
func ReadHoldFrame(r io.Reader, buf []byte, max int) (byte, []byte, error) {
	var hdr [5]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, nil, err
	}
	n := int(binary.BigEndian.Uint32(hdr[1:]))
	if n > max {
		return 0, nil, &HoldFrameSizeError{Size: n, Max: max}
	}
	if cap(buf) < n {
		buf = make([]byte, n)
	}
	buf = buf[:n]
	if _, err := io.ReadFull(r, buf); err != nil {
		return 0, nil, err
	}
	return hdr[0], buf, nil
}

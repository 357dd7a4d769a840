package cli

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc/client"
)

// The machine-readable output of nook (--json); docs/json.md is its
// reference and must change with it.

// Error codes of nook itself, besides the daemon's errdefs kinds.
const (
	codeUsage            = "usage"              // the command line is wrong
	codeDaemonNotRunning = "daemon_not_running" // nothing answers on the socket
)

// errorJSON is every error under --json.
type errorJSON struct {
	Type    string `json:"type"` // always "error"
	Code    string `json:"code"`
	Message string `json:"message"`
	Hint    string `json:"hint"`
}

// errorRecord splits err into a code, the message saying what failed and
// a hint saying what to do.
func errorRecord(err error) errorJSON {
	code := string(errdefs.KindOf(err))
	var ue *usageError
	switch {
	case errors.As(err, &ue):
		code = codeUsage
	case errors.Is(err, client.ErrDaemonNotRunning):
		code = codeDaemonNotRunning
	}
	msg, hint := splitHint(err.Error())
	if hint == "" {
		hint = defaultHints[code]
		if ue != nil && ue.cmd != nil {
			hint = "usage: " + synopsis(ue.cmd) + "; see `nook help " + strings.TrimSpace(ue.cmd.path()) + "`"
		}
	}
	return errorJSON{Type: "error", Code: code, Message: msg, Hint: hint}
}

// splitHint separates what to do from what failed: the lines after the
// first; else the last ": "-separated part when it is advice (it starts
// with a verb such as run, add or create) or names a command (nook's
// messages end with ": run `nook reset` ..." and the like); else, within
// that last part, what follows a "; " that starts with such a verb.
func splitHint(s string) (msg, hint string) {
	s = strings.TrimSpace(strings.TrimPrefix(s, "nook: "))
	if first, rest, ok := strings.Cut(s, "\n"); ok {
		return strings.TrimSpace(first), strings.TrimSpace(rest)
	}
	i := strings.LastIndex(s, ": ")
	if i > 0 && (advice(s[i+2:]) || strings.Contains(s[i:], "`")) {
		return s[:i], s[i+2:]
	}
	for j := i + 1; ; {
		k := strings.Index(s[j:], "; ")
		if k < 0 {
			break
		}
		if advice(s[j+k+2:]) {
			return s[:j+k], s[j+k+2:]
		}
		j += k + 2
	}
	return s, ""
}

// adviceVerbs start the sentences of nook's and sandboxd's messages that
// say what to do.
var adviceVerbs = map[string]bool{
	"add": true, "attach": true, "cd": true, "check": true, "commit": true, "configure": true, "create": true,
	"delete": true, "fix": true, "install": true, "pass": true, "push": true, "remove": true, "resolve": true,
	"restart": true, "run": true, "see": true, "set": true, "start": true, "stop": true, "try": true, "use": true,
	"wait": true,
}

func advice(s string) bool {
	word, _, _ := strings.Cut(s, " ")
	return adviceVerbs[word]
}

// defaultHints are the hints of errors that carry none of their own.
var defaultHints = map[string]string{
	codeDaemonNotRunning:             "start it with `sandboxd` (or `systemctl --user start sandboxd.socket`), or unset SANDBOXD_NO_AUTOSTART so that nook starts it",
	string(errdefs.KindUnavailable):  "sandboxd or the remote did not answer; try again, and `nook doctor` checks each part",
	string(errdefs.KindInternal):     "see the daemon's log (`journalctl --user -u sandboxd`, or sandboxd.log in the state directory) and `nook doctor`",
	string(errdefs.KindNotFound):     "`nook list --all` lists the sandboxes sandboxd knows",
	string(errdefs.KindTimeout):      "the remote is slow or stuck; `nook status` and `nook events` show where the sandbox is",
	string(errdefs.KindUnauthorized): "check the access token (`nook config` says where it comes from)",
}

// ndjson writes one JSON record per line; safe for concurrent use (stdout
// and stderr chunks of an exec arrive from different goroutines).
type ndjson struct {
	mu sync.Mutex
	w  io.Writer
}

func (n *ndjson) write(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	_, err = n.w.Write(append(b, '\n'))
	return err
}

// outputJSON is one chunk of a command's output under `exec --json`: Text
// when the bytes are UTF-8, else Base64.
type outputJSON struct {
	Type   string `json:"type"` // "output"
	Stream string `json:"stream"`
	Text   string `json:"text,omitempty"`
	Base64 string `json:"base64,omitempty"`
}

// streamWriter turns one output stream into output records. It holds back
// the incomplete UTF-8 sequence at the end of a chunk until the next, so
// that text split across chunks stays text.
type streamWriter struct {
	out     *ndjson
	stream  string
	pending []byte
}

func (s *streamWriter) Write(p []byte) (int, error) {
	buf := append(s.pending, p...)
	s.pending = nil
	cut := len(buf)
	// Back up over at most 3 bytes of a rune that is not complete yet.
	for i := len(buf) - 1; i >= 0 && i >= len(buf)-3; i-- {
		if utf8.RuneStart(buf[i]) {
			if !utf8.FullRune(buf[i:]) {
				cut = i
			}
			break
		}
	}
	if cut < len(buf) {
		s.pending = append([]byte{}, buf[cut:]...)
		buf = buf[:cut]
	}
	if len(buf) == 0 {
		return len(p), nil
	}
	return len(p), s.out.write(s.record(buf))
}

func (s *streamWriter) record(b []byte) outputJSON {
	if utf8.Valid(b) {
		return outputJSON{Type: "output", Stream: s.stream, Text: string(b)}
	}
	return outputJSON{Type: "output", Stream: s.stream, Base64: base64.StdEncoding.EncodeToString(b)}
}

// flush writes what is held back (a stream that ended mid-rune).
func (s *streamWriter) flush() error {
	if len(s.pending) == 0 {
		return nil
	}
	b := s.pending
	s.pending = nil
	return s.out.write(s.record(b))
}

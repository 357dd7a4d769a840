package sessions

import (
	"bytes"
	"errors"
	"fmt"
	"path"
	"strings"
	"time"
	"unicode"
)

// Answers read from the sandbox are an adversary's input: each is kept in a
// buffer of a fixed size and waited for within a fixed time, and checked
// before use.

// errAnswerTooLong is returned by an answerBuffer's Write past its bound;
// the SSH relay then discards the rest of the stream.
var errAnswerTooLong = errors.New("the sandbox's answer is longer than expected")

// answerBuffer keeps at most max bytes of a stream; past them it calls
// onOver (if set: the caller stops waiting for the rest) once.
type answerBuffer struct {
	buf    bytes.Buffer
	max    int
	over   bool
	onOver func()
}

func newAnswer(max int) *answerBuffer { return &answerBuffer{max: max} }

func (a *answerBuffer) Write(p []byte) (int, error) {
	room := a.max - a.buf.Len()
	if len(p) > room {
		a.buf.Write(p[:max(room, 0)])
		if !a.over && a.onOver != nil {
			a.onOver()
		}
		a.over = true
		return max(room, 0), errAnswerTooLong
	}
	return a.buf.Write(p)
}

func (a *answerBuffer) Bytes() []byte  { return a.buf.Bytes() }
func (a *answerBuffer) String() string { return a.buf.String() }

// printable is s as one line safe for a terminal: control characters (a
// terminal escape, a newline) become spaces, and it is cut to max bytes.
func printable(s string, max int) string {
	if len(s) > max {
		s = s[:max] + "…"
	}
	return strings.Map(func(r rune) rune {
		if unicode.IsControl(r) || r == unicode.ReplacementChar {
			return ' '
		}
		return r
	}, s)
}

// Bounds of the managed-process directives.
const (
	// processRecordMax bounds one process record: its command came in one
	// SSH packet (at most 256 KiB), plus two paths and some numbers.
	processRecordMax = 512 << 10
	// processErrorMax bounds what the agent says on stderr.
	processErrorMax = 4 << 10
	// maxPID is Linux's largest pid_max.
	maxPID = 1 << 22
)

// processDirectiveWait bounds one directive: the agent answers at once
// (start returns once the process is spawned). A variable for the tests.
var processDirectiveWait = 30 * time.Second

// processStatuses are the statuses a process record may carry: the local
// remote's agent says running, exited or stopped; starting and failed are
// tolerated for other agents.
var processStatuses = map[string]bool{"running": true, "exited": true, "stopped": true, "starting": true, "failed": true}

// validate checks a process record the agent answered for key: the key it
// was asked about, a known status, sane numbers, and names that are only
// shown or used in the sandbox (absolute paths there, without control
// characters).
func (r *processRecord) validate(key string) error {
	switch {
	case r.Key != "" && r.Key != key:
		return fmt.Errorf("it is the record of %q, not of %q", printable(r.Key, 64), key)
	case !processStatuses[r.Status]:
		return fmt.Errorf("status %q is not one of running, exited, stopped, starting, failed", printable(r.Status, 64))
	case r.PID < 0 || r.PID > maxPID || r.PGID < 0 || r.PGID > maxPID:
		return fmt.Errorf("pid %d / pgid %d are not process ids", r.PID, r.PGID)
	case r.TargetPort < 0 || r.TargetPort > 65535:
		return fmt.Errorf("port %d is not a port", r.TargetPort)
	case r.ExitCode != nil && (*r.ExitCode < -1 || *r.ExitCode > 255):
		return fmt.Errorf("exit code %d is not an exit status", *r.ExitCode)
	case len(r.Signal) > 32 || strings.IndexFunc(r.Signal, func(c rune) bool { return !(c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '+' || c == '-') }) >= 0:
		return fmt.Errorf("signal %q is not a signal name", printable(r.Signal, 64))
	}
	for _, t := range []string{r.StartedAt, r.CompletedAt} {
		if t == "" {
			continue
		}
		if _, err := time.Parse(time.RFC3339Nano, t); err != nil {
			return fmt.Errorf("time %q is not an RFC 3339 time", printable(t, 64))
		}
	}
	for _, p := range []string{r.StdoutPath, r.StderrPath} {
		if p == "" {
			continue
		}
		if len(p) > 4096 || !path.IsAbs(p) || strings.IndexFunc(p, unicode.IsControl) >= 0 {
			return fmt.Errorf("log path %q is not an absolute path of the sandbox", printable(p, 128))
		}
	}
	if strings.IndexFunc(r.Command, func(c rune) bool { return unicode.IsControl(c) && c != '\n' && c != '\t' }) >= 0 {
		return errors.New("its command holds control characters")
	}
	return nil
}

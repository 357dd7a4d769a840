package sessions

import (
	"context"
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/store"
)

// prompter is a remote that summarizes a run as text (results/prompt):
// the RWX runs API and localcloud do.
type prompter interface {
	RunPrompt(ctx context.Context, runID, token string) (string, error)
}

// maxSetupReport bounds what of a failed run's summary is kept and shown.
const maxSetupReport = 4 << 10

// setupFailure says why a run completed before it became sandboxable: the
// remote's summary of the run (the failed task and the end of its output)
// when it gives one, else its failure reason. The summary is the output of
// the run's commands: it is bounded and stripped of control characters.
func (m *Manager) setupFailure(ctx context.Context, remote Remote, s *store.Session, failure string) string {
	why := "the run finished before it became sandboxable"
	if failure != "" {
		why = "the run ended (" + failure + ") before it became sandboxable"
	}
	p, ok := remote.(prompter)
	if !ok {
		return why
	}
	pctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	text, err := p.RunPrompt(pctx, s.RunID, s.Token)
	if err != nil || strings.TrimSpace(text) == "" {
		if err != nil {
			m.log.Debug("ask the remote why the run failed", "run", s.RunID, "err", err)
		}
		return why
	}
	return printableTail(text, maxSetupReport)
}

// printableTail keeps at most max bytes of text (its end, where a failure
// shows), valid UTF-8, with control characters other than newline and tab
// replaced, so nothing in it drives the reader's terminal.
func printableTail(text string, max int) string {
	text = strings.TrimSpace(strings.ToValidUTF8(text, "?"))
	if len(text) > max {
		cut := len(text) - max
		for cut < len(text) && !utf8.RuneStart(text[cut]) {
			cut++
		}
		text = "..." + text[cut:]
	}
	return strings.Map(func(r rune) rune {
		if r == '\n' || r == '\t' || !unicode.IsControl(r) {
			return r
		}
		return '?'
	}, text)
}

// setupFailedError is a sandbox whose setup failed: running the command
// again starts a sandbox that fails the same way, so the message says what
// to change instead of suggesting a retry.
type setupFailedError struct{ err error }

func (e *setupFailedError) Error() string { return e.err.Error() }
func (e *setupFailedError) Unwrap() error { return e.err }

// NoRetryHint tells the exec route not to call the command safe to retry.
func (e *setupFailedError) NoRetryHint() bool { return true }

func setupFailedErr(s *store.Session) error {
	cfg := s.ConfigFile
	if cfg == "" || strings.HasPrefix(cfg, "run:") {
		cfg = "the sandbox config"
	}
	return &setupFailedError{errdefs.Gone(fmt.Errorf("sandbox run %s failed before it became ready:\n%s\nA new sandbox fails the same way until the setup changes: fix the failing task in %s (or what it depends on), then run the command again", s.RunID, s.StateReason, cfg))}
}

// endedBeforeReady ends session s, whose run completed before it became
// sandboxable, with the remote's account of why; a failed setup gets an
// error saying what to change.
func (m *Manager) endedBeforeReady(ctx context.Context, remote Remote, s *store.Session, failure string) (*store.Session, error) {
	s = m.expire(s, m.setupFailure(ctx, remote, s, failure))
	if failure == "failed" {
		return s, setupFailedErr(s)
	}
	return s, endedError(s)
}

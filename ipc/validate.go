package ipc

import (
	"path/filepath"
	"strings"
	"unicode/utf8"

	"github.com/sandboxd/sandboxd/errdefs"
)

// Validation at the edge: what can be checked without the daemon's state is
// refused here with a 400 and a message naming the field. Validate methods
// also normalise (clean) paths.

// Validate checks that t names a session: a run id, or an absolute cwd.
func (t *Target) Validate() error {
	if t.Cwd == "" && t.RunID == "" {
		return errdefs.Invalidf("cwd or runId is required: send the caller's absolute working directory, or a run id")
	}
	if t.Cwd != "" {
		cwd, err := cleanAbs("cwd", t.Cwd)
		if err != nil {
			return err
		}
		t.Cwd = cwd
	}
	if strings.ContainsRune(t.RunID, '/') || strings.TrimSpace(t.RunID) != t.RunID {
		return errdefs.Invalidf("runId %q is not a run id", t.RunID)
	}
	if t.ConfigFile != "" && !filepath.IsAbs(t.ConfigFile) && t.Cwd == "" {
		return errdefs.Invalidf("configFile %q is relative, so cwd is required to resolve it", t.ConfigFile)
	}
	if strings.ContainsRune(t.Cwd+t.ConfigFile+t.RunID, 0) {
		return errdefs.Invalidf("cwd, configFile and runId must not contain NUL bytes")
	}
	return nil
}

// Validate checks a start or reset request.
func (r *StartRequest) Validate() error {
	if err := r.Target.Validate(); err != nil {
		return err
	}
	for k := range r.Init {
		if strings.TrimSpace(k) == "" {
			return errdefs.Invalidf("init parameter with an empty key: pass them as key=value")
		}
	}
	if r.WaitTimeoutSeconds < 0 {
		return errdefs.Invalidf("waitTimeoutSeconds must not be negative, got %d", r.WaitTimeoutSeconds)
	}
	return nil
}

// Validate checks a stop request: a target, or all, not both.
func (r *StopRequest) Validate() error {
	if r.All {
		if r.Cwd != "" || r.RunID != "" || r.ConfigFile != "" {
			return errdefs.Invalidf("all=true stops every session: do not combine it with cwd, configFile or runId")
		}
		return nil
	}
	return r.Target.Validate()
}

// Validate checks an init request.
func (r *InitRequest) Validate() error {
	if r.Cwd == "" {
		return errdefs.Invalidf("cwd is required: send the caller's absolute working directory")
	}
	cwd, err := cleanAbs("cwd", r.Cwd)
	if err != nil {
		return err
	}
	r.Cwd = cwd
	if strings.ContainsRune(r.Cwd+r.File, 0) {
		return errdefs.Invalidf("cwd and file must not contain NUL bytes")
	}
	return nil
}

// Validate checks an exec request.
func (r *ExecRequest) Validate() error {
	if err := r.Target.Validate(); err != nil {
		return err
	}
	if r.Attach != "" {
		// An attach runs nothing: it follows a detached command.
		if len(r.Argv) > 0 || r.Detach || r.TTY != nil || r.Stdin || len(r.Env) > 0 {
			return errdefs.Invalidf("attach follows a detached command: it takes no argv, detach, tty, stdin or env")
		}
		return nil
	}
	if len(r.Argv) == 0 {
		return errdefs.Invalidf("argv is empty: give the command to run, for example [\"make\",\"test\"] (nook exec -- make test)")
	}
	if r.Argv[0] == "" {
		return errdefs.Invalidf("argv[0] is empty: the first element is the program to run")
	}
	for i, a := range r.Argv {
		if strings.ContainsRune(a, 0) {
			return errdefs.Invalidf("argv[%d] contains a NUL byte, which no command can receive", i)
		}
	}
	if r.TTY != nil {
		if err := r.TTY.WindowSize.Validate(); err != nil {
			return err
		}
		if strings.ContainsAny(r.TTY.Term, "\x00\n") || len(r.TTY.Term) > 64 {
			return errdefs.Invalidf("tty.term %q is not a terminal type: send $TERM, e.g. xterm-256color", r.TTY.Term)
		}
	}
	for k, v := range r.Env {
		if !validEnvName(k) {
			return errdefs.Invalidf("env name %q is not a variable name: use letters, digits and underscores, not starting with a digit", k)
		}
		if strings.ContainsRune(v, 0) {
			return errdefs.Invalidf("env %s contains a NUL byte, which no command can receive", k)
		}
	}
	return r.CheckText()
}

// CheckText refuses an exec request that JSON cannot carry as it is: JSON
// strings are UTF-8, and encoding would silently replace invalid bytes with
// U+FFFD, running a different command than asked. Clients call it before
// sending (the daemon only ever sees the replaced text).
func (r *ExecRequest) CheckText() error {
	for i, a := range r.Argv {
		if !utf8.ValidString(a) {
			return errdefs.Invalidf("argv[%d] %q is not valid UTF-8: sandboxd passes commands as text; run a script in the sandbox that produces those bytes instead (for example with printf '\\xNN')", i, a)
		}
	}
	for k, v := range r.Env {
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			return errdefs.Invalidf("env %q is not valid UTF-8: sandboxd passes the environment as text", k)
		}
	}
	return nil
}

// maxWindow bounds a terminal's columns and rows.
const maxWindow = 10000

// Validate checks a terminal size: 0 (unknown) up to maxWindow.
func (w WindowSize) Validate() error {
	if w.Cols < 0 || w.Rows < 0 || w.Cols > maxWindow || w.Rows > maxWindow {
		return errdefs.Invalidf("terminal size %dx%d is out of range: columns and rows are 0 to %d", w.Cols, w.Rows, maxWindow)
	}
	return nil
}

// validEnvName reports whether k is a POSIX shell variable name, the only
// names a shell passes on reliably.
func validEnvName(k string) bool {
	if k == "" || k[0] >= '0' && k[0] <= '9' {
		return false
	}
	for _, c := range k {
		if !(c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

// cleanAbs is filepath.Clean for a path that must be absolute.
func cleanAbs(what, p string) (string, error) {
	if !filepath.IsAbs(p) {
		return "", errdefs.Invalidf("%s %q is not an absolute path: send the absolute path", what, p)
	}
	return filepath.Clean(p), nil
}

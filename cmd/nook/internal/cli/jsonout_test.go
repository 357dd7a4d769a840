package cli

import (
	"bytes"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
)

// A rune split across two chunks stays text; bytes that are not UTF-8 are
// carried as base64.
func TestStreamWriterKeepsRunesWhole(t *testing.T) {
	var b bytes.Buffer
	w := &streamWriter{out: &ndjson{w: &b}, stream: "stdout"}
	w.Write([]byte("caf\xc3"))
	w.Write([]byte("\xa9!"))
	w.Write([]byte("\xff"))
	w.Write([]byte("\xe2\x82")) // an unfinished rune at the end
	w.flush()
	want := `{"type":"output","stream":"stdout","text":"caf"}
{"type":"output","stream":"stdout","text":"é!"}
{"type":"output","stream":"stdout","base64":"/w=="}
{"type":"output","stream":"stdout","base64":"4oI="}
`
	if b.String() != want {
		t.Fatalf("records:\n%s\nwant:\n%s", b.String(), want)
	}
}

func TestSplitHint(t *testing.T) {
	for _, c := range []struct{ in, msg, hint string }{
		{"no session for run x: attach to it with `nook start --id x`", "no session for run x", "attach to it with `nook start --id x`"},
		{"sandboxd is not running\nstart it with `sandboxd`", "sandboxd is not running", "start it with `sandboxd`"},
		{"create the sandbox run: remote said no", "create the sandbox run: remote said no", ""},
		{"/tmp is not inside a git repository: run nook from your project's checkout", "/tmp is not inside a git repository", "run nook from your project's checkout"},
		{"the repository /r has no `origin` remote: a cloud sandbox clones from origin; add one (git remote add origin URL) and push",
			"the repository /r has no `origin` remote: a cloud sandbox clones from origin", "add one (git remote add origin URL) and push"},
		{"sync your changes: push the patch: exit 1", "sync your changes: push the patch: exit 1", ""},
	} {
		msg, hint := splitHint(c.in)
		if msg != c.msg || hint != c.hint {
			t.Errorf("splitHint(%q) = %q, %q", c.in, msg, hint)
		}
	}
	if e := errorRecord(&usageError{cmd: root().sub("exec"), msg: "unknown flag --x"}); e.Code != "usage" || !strings.Contains(e.Hint, "nook help exec") {
		t.Errorf("usage error record %+v", e)
	}
}

// Under --json every error is one JSON object on stdout, nothing on
// stderr, and the exit code is the one without --json.
func TestErrorsUnderJSON(t *testing.T) {
	h := newHarness(t)
	for _, args := range [][]string{
		{"exec", "--json", "--bogus", "--", "true"},
		{"--json", "frobnicate"},
		{"help", "nope", "--json"},
	} {
		code := h.run(args...)
		var e errorJSON
		if err := json.Unmarshal(h.stdout.Bytes(), &e); err != nil || code != ExitFailure || h.stderr.Len() != 0 || e.Type != "error" || e.Code != "usage" || e.Message == "" || e.Hint == "" {
			t.Errorf("%q: exit %d stdout %q stderr %q", args, code, h.stdout.String(), h.stderr.String())
		}
	}
	h.env["SANDBOXD_NO_AUTOSTART"] = "1"
	h.env["SANDBOXD_SOCKET"] = filepath.Join(h.srv.Dir, "missing.sock")
	code := h.run("list", "--json")
	var e errorJSON
	if err := json.Unmarshal(h.stdout.Bytes(), &e); err != nil || code != ExitFailure || h.stderr.Len() != 0 || e.Code != "daemon_not_running" || !strings.Contains(e.Hint, "sandboxd") {
		t.Errorf("no daemon: exit %d stdout %q stderr %q", code, h.stdout.String(), h.stderr.String())
	}
}

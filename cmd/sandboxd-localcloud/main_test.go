package main

import (
	"bytes"
	"encoding/json"
	"path/filepath"
	"testing"
)

func TestCommandsWithoutAServer(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	var out, errb bytes.Buffer
	if code := run([]string{"status", "--state-dir", dir, "--json"}, &out, &errb); code != 1 {
		t.Fatalf("status of nothing: exit %d", code)
	}
	var st struct {
		Running bool   `json:"running"`
		Error   string `json:"error"`
	}
	if err := json.Unmarshal(out.Bytes(), &st); err != nil || st.Running || st.Error == "" {
		t.Fatalf("status --json: %s (%v)", out.String(), err)
	}
	out.Reset()
	if code := run([]string{"stop", "--state-dir", dir, "--json"}, &out, &errb); code != 0 {
		t.Fatalf("stop of nothing: exit %d: %s", code, errb.String())
	}
	if code := run([]string{"bogus"}, &out, &errb); code != 2 {
		t.Fatalf("unknown command: exit %d", code)
	}
	if code := run([]string{"serve", "--idle-timeout", "soon"}, &out, &errb); code != 2 {
		t.Fatalf("bad flag: exit %d", code)
	}
}

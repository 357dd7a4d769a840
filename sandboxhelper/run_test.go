package sandboxhelper

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// run passes the push's entries on undecoded: what it sends is read by the
// server as the pushRequest the daemon meant.
func TestForwardedPushIsThePushRequest(t *testing.T) {
	want := pushRequest{Head: "0123456789abcdef0123456789abcdef01234567", Time: 1700000000, SnapRef: "refs/sandboxd/snap", BaseRef: "refs/sandboxd/base",
		Entries: []PushEntry{{Path: "a.txt", Mode: 0o100644, Data: []byte("a\n")}, {Path: "gone", OID: "x"}}}
	raw, err := json.Marshal(want.Entries)
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(forwardedPush{Head: want.Head, Entries: raw, Time: want.Time, SnapRef: want.SnapRef, BaseRef: want.BaseRef})
	if err != nil {
		t.Fatal(err)
	}
	var got pushRequest
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("the server reads %+v, want %+v", got, want)
	}
}

// Entries that are not JSON, or more than a request may carry, stop run
// before it touches anything (no result file, no question to the server).
func TestRunRefusesBadEntries(t *testing.T) {
	for name, entries := range map[string][]byte{
		"not JSON": []byte(`[{"path":`),
		"too big":  append(append([]byte(`"`), bytes.Repeat([]byte("a"), maxRequest)...), '"'),
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			result := filepath.Join(dir, "run")
			var log bytes.Buffer
			code := Run(context.Background(), &log, RunOptions{State: dir, Result: result}, entries, nil, io.Discard, io.Discard)
			if code != exitUsage || !strings.Contains(log.String(), "read the entries") {
				t.Fatalf("run: exit %d, log %q", code, log.String())
			}
			if _, err := os.Stat(result); !errors.Is(err, fs.ErrNotExist) {
				t.Fatalf("run wrote its result file: %v", err)
			}
		})
	}
}

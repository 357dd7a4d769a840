package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/ipc"
)

// frames are what the daemon sends, coded by encoding/json as it does.
func frames(t testing.TB) [][]byte {
	var out [][]byte
	for _, f := range []ipc.ExecOutput{
		{Type: ipc.ExecStarted},
		{Type: ipc.ExecQueued, Position: 3},
		{Type: ipc.ExecQueued, Message: "starting the sandbox <run 1> & more \u2028 é \x01"},
		{Type: ipc.ExecStdout, Data: []byte("hello\n")},
		{Type: ipc.ExecStderr, Data: []byte{0, 0xff, 0xfe, '\n'}},
		{Type: ipc.ExecStdout, Data: []byte{}},
		{Type: ipc.ExecWarning, Message: `quotes " and \ backslashes, tab	and newline
`},
		{Type: ipc.ExecExit, Result: &ipc.ExecResult{RunID: "r1", RunURL: "https://x/y?a=1&b=2", ExitCode: -1, Signal: "INT",
			PulledFiles: []string{"a b.txt", "é/ü", ""}, DurationMs: 1 << 40, Warnings: []string{"w"}}},
		{Type: ipc.ExecExit, Result: &ipc.ExecResult{RunID: "r2", PulledFiles: []string{}}},
		{Type: ipc.ExecError, Error: &ipc.ErrorDetail{Code: "unavailable", Message: "the sandbox 😀 went away"}},
	} {
		b, err := json.Marshal(f)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, append(b, '\n'))
	}
	return out
}

// The hand decoder decodes what the daemon sends itself (so nook's path
// skips encoding/json), and agrees with encoding/json on it.
func TestExecWireDecodesTheDaemonsFrames(t *testing.T) {
	for _, b := range frames(t) {
		got, ok := decodeExecOutput(b)
		if !ok {
			t.Fatalf("the hand decoder left %s to encoding/json", b)
		}
		var want ipc.ExecOutput
		if err := json.Unmarshal(b, &want); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%s: hand decoder %+v, encoding/json %+v", b, got, want)
		}
	}
	// What it does not take goes to encoding/json, whose answer counts.
	for _, b := range []string{
		`{"Type":"stdout"}`, `{"type":null}`, `{"type":"x","extra":1}`, `{"position":1.5}`,
		`{"message":"\ud83d\ude00"}`, `{"type":"a"} {"type":"b"}`, `{"position":99999999999999999999}`,
		"{\"type\":\"\xff\"}", "{\"message\":\"a\\n\xff\"}", `{"position":01}`,
	} {
		if f, ok := decodeExecOutput([]byte(b)); ok {
			t.Errorf("%s: the hand decoder answered %+v", b, f)
		}
	}
	f, err := decodeFrame([]byte(`{"Type":"stdout","message":"\ud83d\ude00"}`))
	if err != nil || f.Type != "stdout" || f.Message != "😀" {
		t.Fatalf("fallback: %+v, %v", f, err)
	}
}

// The hand encoder writes what encoding/json reads back as the request.
func TestExecWireEncodesRequests(t *testing.T) {
	for _, req := range []ipc.ExecRequest{
		{Argv: []string{"true"}},
		{Target: ipc.Target{Cwd: "/home/a b/é", ConfigFile: ".rwx/x.yml", RunID: "r"}, Argv: []string{"sh", "-c", "echo \"$X\" \\ \x01 <>&"},
			NoSync: true, Reset: true, Root: true, Env: map[string]string{"B": "2", "A": "", "C": "é\n"}, Stdin: true,
			TTY: &ipc.TTY{Term: "xterm-256color", WindowSize: ipc.WindowSize{Cols: 80, Rows: 24}}},
		{Argv: []string{}},
		{},
	} {
		b, ok := appendExecRequest(nil, req)
		if !ok {
			t.Fatalf("%+v left to encoding/json", req)
		}
		checkSameRequest(t, b, req)
	}
	if _, ok := appendExecRequest(nil, ipc.ExecRequest{Target: ipc.Target{Cwd: "/bad/\xff"}, Argv: []string{"true"}}); ok {
		t.Fatal("a path that is not UTF-8 was coded by hand (encoding/json changes it)")
	}
	for _, in := range []ipc.ExecInput{{StdinEOF: true}, {Stdin: []byte{0, 1, 2, 0xff}}, {Signal: "INT"}, {Resize: &ipc.WindowSize{Cols: 1, Rows: 2}}} {
		b, ok := appendExecInput(nil, in)
		if !ok {
			t.Fatalf("%+v left to encoding/json", in)
		}
		var got ipc.ExecInput
		if err := json.Unmarshal(b, &got); err != nil || !reflect.DeepEqual(got, in) {
			t.Fatalf("%s read back as %+v (%v), want %+v", b, got, err, in)
		}
	}
}

func checkSameRequest(t *testing.T, b []byte, req ipc.ExecRequest) {
	t.Helper()
	if !json.Valid(b) {
		t.Fatalf("not JSON: %q", b)
	}
	std, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	var got, want ipc.ExecRequest
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatalf("%s: %v", b, err)
	}
	if err := json.Unmarshal(std, &want); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("hand coded %s reads as %+v; encoding/json's %s as %+v", b, got, std, want)
	}
}

// Wherever the hand code answers, it agrees with encoding/json.
func FuzzExecWire(f *testing.F) {
	for _, b := range frames(f) {
		f.Add(b, "sh", "-c", "A", "v", false)
	}
	f.Add([]byte(`{"type":"exit","result":{"exitCode":-0,"pulledFiles":[]}}`), "é", "\x00", "\xff", "", true)
	f.Add([]byte(`{ "type" : "x" , "data" : "aGk=\r\n" }`), "\\", "\"", "K", "\u2028", true)
	f.Fuzz(func(t *testing.T, frame []byte, a0, a1, k, v string, flag bool) {
		if got, ok := decodeExecOutput(frame); ok {
			var want ipc.ExecOutput
			if err := json.Unmarshal(frame, &want); err != nil {
				t.Fatalf("%q: hand decoder %+v, encoding/json fails: %v", frame, got, err)
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("%q: hand decoder %+v, encoding/json %+v", frame, got, want)
			}
		}
		req := ipc.ExecRequest{Target: ipc.Target{Cwd: a1, RunID: k}, Argv: []string{a0, a1}, NoSync: flag, Env: map[string]string{k: v, strings.ToUpper(k) + "_": a0}}
		if flag {
			req.TTY = &ipc.TTY{Term: v, WindowSize: ipc.WindowSize{Cols: len(a0), Rows: -len(a1)}}
		}
		if b, ok := appendExecRequest(nil, req); ok {
			checkSameRequest(t, b, req)
		}
		in := ipc.ExecInput{Stdin: frame, Signal: a0, StdinEOF: flag}
		if b, ok := appendExecInput(nil, in); ok {
			var got, want ipc.ExecInput
			std, _ := json.Marshal(in)
			if err := json.Unmarshal(b, &got); err != nil || json.Unmarshal(std, &want) != nil || !reflect.DeepEqual(got, want) {
				t.Fatalf("%s read back as %+v (%v), encoding/json's as %+v", b, got, err, want)
			}
		}
	})
}

// A frame longer than the reader's buffer (a large chunk of output), and a
// daemon whose frames the hand decoder does not take, are relayed whole.
func TestExecFramesLongAndUnknown(t *testing.T) {
	big := make([]byte, 200<<10)
	for i := range big {
		big[i] = byte(i)
	}
	var body []byte
	for _, f := range []any{
		ipc.ExecOutput{Type: ipc.ExecStdout, Data: big},
		map[string]any{"type": "stderr", "data": []byte("from a newer daemon"), "newField": 1},
		ipc.ExecOutput{Type: ipc.ExecStdout, Data: []byte("after")},
		ipc.ExecOutput{Type: ipc.ExecExit, Result: &ipc.ExecResult{RunID: "r", ExitCode: 7}},
	} {
		b, err := json.Marshal(f)
		if err != nil {
			t.Fatal(err)
		}
		body = append(append(body, b...), '\n')
	}
	var stdout, stderr bytes.Buffer
	c := &Client{}
	res, err := c.readExec(context.Background(), bytes.NewReader(body), 200, ExecOptions{Stdout: &stdout, Stderr: &stderr}, nil)
	if err != nil || res.ExitCode != 7 {
		t.Fatalf("result %+v, %v", res, err)
	}
	if !bytes.Equal(stdout.Bytes(), append(big, "after"...)) || stderr.String() != "from a newer daemon" {
		t.Fatalf("stdout %d bytes, stderr %q", stdout.Len(), stderr.String())
	}
}

// A long frame is taken by the hand decoder too (encoding/json is not left
// to read the rest of the stream).
func TestExecFrameLongerThanTheBuffer(t *testing.T) {
	b, err := json.Marshal(ipc.ExecOutput{Type: ipc.ExecStdout, Data: make([]byte, 100<<10)})
	if err != nil {
		t.Fatal(err)
	}
	r := frameReader{br: bufio.NewReaderSize(bytes.NewReader(append(b, '\n')), 4096)}
	f, err := r.next()
	if err != nil || len(f.Data) != 100<<10 || r.dec != nil {
		t.Fatalf("frame of %d bytes, %v, left to encoding/json: %v", len(f.Data), err, r.dec != nil)
	}
}

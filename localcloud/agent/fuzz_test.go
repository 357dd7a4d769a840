package agent

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/crypto/ssh"
)

// fuzzRequestTypes are the channel requests a client can send; the fuzzer
// picks among them (and one unknown type) with a byte.
var fuzzRequestTypes = []string{"env", "pty-req", "window-change", "exec", "shell", "signal", "keepalive@openssh.com", "x-unknown"}

// FuzzSessionRequests: any sequence of channel requests with any payloads
// (what a client sends before and around its command: env, pty, window
// size, exec with a directive or command line, signals) is answered
// without a panic; at most one exec or shell is accepted per channel;
// environment names are never empty or hold '=' or NUL; a signal is
// accepted only once a command was accepted. The work an accepted exec
// would start is not run (the command would be whatever the fuzzer wrote).
func FuzzSessionRequests(f *testing.F) {
	enc := func(reqs ...any) []byte {
		var b []byte
		for i := 0; i < len(reqs); i += 2 {
			var p []byte
			if reqs[i+1] != nil {
				p = ssh.Marshal(reqs[i+1])
			}
			b = append(b, reqs[i].(byte), byte(len(p)))
			b = append(b, p...)
		}
		return b
	}
	f.Add(enc(byte(0), struct{ Name, Value string }{"A", "b"}, byte(3), struct{ Command string }{DirectiveLockRequested}, byte(5), struct{ Signal string }{"INT"}))
	f.Add(enc(byte(1), ptyRequest{Term: "xterm", Columns: 80, Rows: 24}, byte(2), windowChange{Columns: 100, Rows: 30}, byte(4), nil))
	f.Add(enc(byte(5), struct{ Signal string }{"TERM"}, byte(3), struct{ Command string }{"echo hi"}, byte(3), struct{ Command string }{"echo again"}))
	f.Add(enc(byte(0), struct{ Name, Value string }{"A=B", "c"}, byte(0), struct{ Name, Value string }{"", "c"}, byte(7), nil))
	f.Add([]byte{3, 2, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		s := &session{conn: &connState{agent: &Agent{}}}
		accepted := 0
		for len(data) >= 2 {
			typ := fuzzRequestTypes[int(data[0])%len(fuzzRequestTypes)]
			n := min(int(data[1]), len(data)-2)
			payload := data[2 : 2+n]
			data = data[2+n:]
			ok, work := s.handle(&ssh.Request{Type: typ, Payload: payload})
			switch typ {
			case "exec", "shell":
				if ok {
					accepted++
					if work == nil {
						t.Fatal("an accepted exec without work")
					}
				} else if work != nil {
					t.Fatal("a refused exec with work")
				}
			case "signal":
				if ok && accepted == 0 {
					t.Fatal("a signal was accepted with no command")
				}
			}
		}
		if accepted > 1 {
			t.Fatalf("%d commands accepted on one channel", accepted)
		}
		for _, kv := range s.env {
			name, _, _ := strings.Cut(kv, "=")
			if name == "" || strings.ContainsRune(name, 0) {
				t.Fatalf("environment entry %q accepted", kv)
			}
		}
		if s.proc != nil {
			t.Fatal("a process was started")
		}
	})
}

// FuzzProcessRequest: the JSON request of the managed-process directives
// (`__rwx_sandbox_process_<op>__ <json>`) is parsed and checked without a
// panic; a key that passes is safe as a file name under the process
// directory (its logs are named after it). Only the directives that start
// nothing are run: on an empty table each must answer an error naming what
// is wrong.
func FuzzProcessRequest(f *testing.F) {
	for _, s := range []string{
		`{"key":"web","command":"python3 -m http.server 8000","targetPort":8000}`,
		`{"key":"../../etc/passwd"}`,
		`{"key":"a b"}`,
		`{"key":""}`,
		`{"key":"web"} trailing`,
		`{"key":1}`,
		`not json`,
		``,
		`{"key":"` + strings.Repeat("k", 300) + `"}`,
	} {
		for op := range byte(4) {
			f.Add(op, s)
		}
	}
	ops := []string{DirectiveProcessStatus, DirectiveProcessLogs, DirectiveProcessStop, DirectiveProcessRestart}
	f.Fuzz(func(t *testing.T, op byte, arg string) {
		var req processRequest
		if json.Unmarshal([]byte(arg), &req) == nil && validProcessKey(req.Key) == nil {
			k := req.Key
			if k == "." || k == ".." || filepath.Base(k) != k || strings.ContainsAny(k, "/\x00") {
				t.Fatalf("key %q was accepted but is not a plain file name", k)
			}
		}
		a := &Agent{}
		_, err := a.process(ops[int(op)%len(ops)], arg)
		if err == nil {
			t.Fatalf("%s %q on an empty table succeeded", ops[int(op)%len(ops)], arg)
		}
		if err.Error() == "" {
			t.Fatal("an error without a message")
		}
	})
}

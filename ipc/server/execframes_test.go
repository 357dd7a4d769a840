package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/ipctest"
	"github.com/sandboxd/sandboxd/ipc/server"
)

// The exec answers binary frames only to a request that asks for them
// (Sandboxd-Exec-Frames: binary): the output's bytes as they are, a write
// longer than a frame's bound split, control frames as the NDJSON lines'
// JSON. A request without the header (curl, the Neovim plugin) gets the
// same exec as NDJSON.
func TestExecAnswersBinaryFramesOnlyWhenAsked(t *testing.T) {
	s := start(t, ipctest.Options{})
	big := bytes.Repeat([]byte{0, 0xff, '\n', '"'}, ipc.MaxFramePayload/4+10)
	s.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		if err := st.Send(ipc.ExecOutput{Type: ipc.ExecStarted}); err != nil {
			return ipc.ExecResult{}, err
		}
		st.Stdout().Write(big)
		io.WriteString(st.Stderr(), "warn\n")
		return ipc.ExecResult{RunID: "run-1", ExitCode: 3}, nil
	}
	body := `{"cwd":"/x","argv":["cat"]}`

	code, h, b, err := rawRequestH(s.Socket, "POST", "/v1/exec", http.Header{ipc.HeaderExecFrames: {ipc.ExecFramesBinary}}, strings.NewReader(body))
	if err != nil || code != 200 || h.Get("Content-Type") != ipc.ContentTypeExecFrames {
		t.Fatalf("exec asking for binary frames: %d %v %q", code, err, h.Get("Content-Type"))
	}
	fr := ipc.NewFrameReader(bytes.NewReader(b))
	var kinds []byte
	var stdout, stderr []byte
	var controls []ipc.ExecOutput
	for {
		kind, payload, err := fr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("frame %d: %v", len(kinds), err)
		}
		kinds = append(kinds, kind)
		switch kind {
		case ipc.FrameStdout:
			stdout = append(stdout, payload...)
		case ipc.FrameStderr:
			stderr = append(stderr, payload...)
		case ipc.FrameControl:
			var f ipc.ExecOutput
			if err := json.Unmarshal(payload, &f); err != nil {
				t.Fatalf("control frame %q: %v", payload, err)
			}
			controls = append(controls, f)
		}
	}
	if want := []byte{ipc.FrameControl, ipc.FrameStdout, ipc.FrameStdout, ipc.FrameStderr, ipc.FrameControl}; !bytes.Equal(kinds, want) {
		t.Fatalf("frame kinds %v, want %v", kinds, want)
	}
	if !bytes.Equal(stdout, big) || string(stderr) != "warn\n" {
		t.Fatalf("stdout %d bytes (want %d), stderr %q", len(stdout), len(big), stderr)
	}
	if len(controls) != 2 || controls[0].Type != ipc.ExecStarted || controls[1].Type != ipc.ExecExit || controls[1].Result.ExitCode != 3 {
		t.Fatalf("control frames %+v", controls)
	}

	frames := execFrames(t, s, body)
	var plain []byte
	for _, f := range frames {
		if f.Type == ipc.ExecStdout {
			plain = append(plain, f.Data...)
		}
	}
	if !bytes.Equal(plain, big) || frames[len(frames)-1].Type != ipc.ExecExit {
		t.Fatalf("NDJSON without the header: %d stdout bytes, last frame %+v", len(plain), frames[len(frames)-1])
	}
}

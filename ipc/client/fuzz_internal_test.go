package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// FuzzExecOutputFrames: the client side of the exec stream. Whatever the
// daemon (or whatever answers on the socket) streams back, Exec relays
// exactly the stdout and stderr bytes of the frames before the final one,
// then returns the result of an exit frame or a kinded error with a
// message, never a panic, never a result made up from a stream that ended
// early (that is "unavailable: the command may or may not have completed").
func FuzzExecOutputFrames(f *testing.F) {
	for _, s := range []string{
		`{"type":"queued","position":2}` + "\n" + `{"type":"started"}` + "\n" + `{"type":"stdout","data":"aGk="}` + "\n" + `{"type":"stderr","data":"ZXJy"}` + "\n" + `{"type":"exit","result":{"runId":"r","exitCode":3,"pulledFiles":["a"]}}` + "\n",
		`{"type":"error","error":{"code":"unavailable","message":"the sandbox dropped"}}`,
		`{"type":"error"}`,
		`{"type":"exit"}`,
		`{"type":"stdout","data":"aGk="}`,
		`{"type":"warning","message":"drift"}{"type":"future"}{"type":"exit","result":{"exitCode":0}}`,
		`{"type":"stdout","data":"!!"}`,
		`{"type":"error","error":{"code":"made-up","message":""}}`,
		``,
	} {
		f.Add([]byte(s))
	}
	c := &Client{}
	f.Fuzz(func(t *testing.T, body []byte) {
		var stdout, stderr bytes.Buffer
		res, err := c.readExec(context.Background(), ndjsonFrames{json.NewDecoder(bytes.NewReader(body))}, 200, ExecOptions{Stdout: &stdout, Stderr: &stderr}, nil)

		// What an independent reading of the stream says should happen.
		var wantOut, wantErr []byte
		final := ""
		dec := json.NewDecoder(bytes.NewReader(body))
		for final == "" {
			var fr ipc.ExecOutput
			if dec.Decode(&fr) != nil {
				break
			}
			switch fr.Type {
			case ipc.ExecStdout:
				wantOut = append(wantOut, fr.Data...)
			case ipc.ExecStderr:
				wantErr = append(wantErr, fr.Data...)
			case ipc.ExecExit, ipc.ExecError:
				final = fr.Type
				if fr.Type == ipc.ExecExit && fr.Result == nil {
					final = "bad exit"
				}
			}
		}
		if !bytes.Equal(stdout.Bytes(), wantOut) || !bytes.Equal(stderr.Bytes(), wantErr) {
			t.Fatalf("relayed stdout %q stderr %q, want %q %q", stdout.Bytes(), stderr.Bytes(), wantOut, wantErr)
		}
		switch final {
		case ipc.ExecExit:
			if err != nil {
				t.Fatalf("an exit frame gave an error: %v", err)
			}
		case "":
			if err == nil {
				t.Fatalf("a stream that ended early gave a result %+v", res)
			}
			if errdefs.KindOf(err) != errdefs.KindUnavailable {
				t.Fatalf("a stream that ended early: kind %q, want unavailable: %v", errdefs.KindOf(err), err)
			}
		default:
			if err == nil {
				t.Fatalf("stream %q gave a result %+v", body, res)
			}
			var e *errdefs.Error
			if !errors.As(err, &e) || e.Kind == "" || err.Error() == "" {
				t.Fatalf("an unkinded or empty error: %v", err)
			}
		}
	})
}

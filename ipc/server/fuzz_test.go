package server

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// fuzzBodyLimit keeps fuzzed bodies near the limit cheap.
const fuzzBodyLimit = 4 << 10

// FuzzRequestDecoding: any body sent to a JSON route of the socket is
// decoded and validated into a request, or refused as invalid (400) or too
// large (413); never a panic, never another kind (a 500 would tell the user
// the daemon is broken when their request is).
func FuzzRequestDecoding(f *testing.F) {
	for _, s := range []string{
		`{"cwd":"/src/repo","configFile":".rwx/sandbox.yml"}`,
		`{"cwd":"/src/repo","argv":["make","test"],"noSync":true,"stdin":true,"env":{"A":"b"}}`,
		`{"cwd":"/src/repo","runId":"run-1","init":[{"key":"k","value":"v"}],"wait":true}`,
		`{"all":true}`,
		`{"cwd":"relative","argv":[]}`,
		`{"cwd":"/r","argv":["\u0000"]}`,
		`{"cwd":"/r"}{"cwd":"/r"}`,
		`{"cwd":"/r","unknown":1}`,
		`{"cwd":1}`,
		`[`,
		``,
		`null`,
	} {
		for route := range byte(4) {
			f.Add(route, []byte(s))
		}
	}
	f.Fuzz(func(t *testing.T, route byte, body []byte) {
		r, _ := http.NewRequest(http.MethodPost, "http://sandboxd/v1/x", bytes.NewReader(body))
		r.Body = http.MaxBytesReader(nil, r.Body, fuzzBodyLimit)
		var err error
		switch route % 4 {
		case 0:
			_, err = jsonBody[ipc.StartRequest](r)
		case 1:
			_, err = jsonBody[ipc.StopRequest](r)
		case 2:
			_, err = jsonBody[ipc.InitRequest](r)
		case 3:
			var req ipc.ExecRequest
			if err = decodeBody(r, &req, false); err == nil {
				err = req.Validate()
				if err == nil && len(req.Argv) == 0 {
					t.Fatalf("an exec request without argv was accepted: %s", body)
				}
			}
		}
		checkRequestError(t, body, err)
	})
}

func checkRequestError(t *testing.T, body []byte, err error) {
	t.Helper()
	if err == nil {
		return
	}
	switch errdefs.KindOf(err) {
	case errdefs.KindInvalid, errdefs.KindTooLarge:
	default:
		t.Fatalf("body %q: error of kind %q (want invalid or too_large): %v", body, errdefs.KindOf(err), err)
	}
	if d := errorDetailOf(err); d.Message == "" {
		t.Fatalf("body %q: an error without a message", body)
	}
}

// FuzzExecInputFrames: the server side of the exec stream. Any request body
// (the ExecRequest line, then stdin/signal frames) is read to its end
// without hanging; only valid signals reach the command; a malformed frame
// cancels the exec as invalid, a cut body as cancelled, and nothing else.
func FuzzExecInputFrames(f *testing.F) {
	for _, s := range []string{
		`{"cwd":"/r","argv":["cat"],"stdin":true}` + "\n" + `{"stdin":"aGVsbG8="}` + "\n" + `{"signal":"INT"}` + "\n" + `{"stdinEof":true}` + "\n",
		`{"cwd":"/r","argv":["x"]}` + "\n" + `{"signal":"NOPE"}`,
		`{"cwd":"/r","argv":["x"],"stdin":true}` + "\n" + `{"stdin":"!!"}`,
		`{"cwd":"/r","argv":["x"],"stdin":true}{"stdin":"YQ=="}{"stdinEof":true}{"stdin":"Yg=="}`,
		`{"cwd":"/r","argv":["x"]}` + "\n" + `{"signal":"TERM"`,
		`{"cwd":"/r","argv":["x"]}` + "\n" + `{"extra":1}`,
		`{"cwd":"/r","argv":["x"]}` + "\n" + `[1,2]`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		in := &frameLimitReader{r: bytes.NewReader(body), limit: fuzzBodyLimit}
		dec := json.NewDecoder(in)
		dec.DisallowUnknownFields()
		var req ipc.ExecRequest
		if err := dec.Decode(&req); err != nil {
			if !errors.Is(err, io.EOF) {
				checkRequestError(t, body, jsonError(err))
			}
			return
		}
		if err := req.Validate(); err != nil {
			checkRequestError(t, body, err)
			return
		}
		ctx, cancel := context.WithCancelCause(context.Background())
		defer cancel(nil)
		st := newExecStream(ctx, nil, nil, req.Stdin, slog.New(slog.DiscardHandler))
		done := make(chan struct{})
		go func() {
			defer close(done)
			st.readInput(dec, in, cancel)
		}()
		// The command: reads its stdin and takes signals until both end.
		stdinDone := make(chan error, 1)
		go func() {
			_, err := io.Copy(io.Discard, st.Stdin())
			stdinDone <- err
		}()
		timeout := time.After(10 * time.Second)
		for sig := range st.Signals() {
			if !ipc.ValidSignal(sig) {
				t.Fatalf("invalid signal %q reached the command", sig)
			}
		}
		select {
		case <-done:
		case <-timeout:
			t.Fatalf("reading the input of %q never ended", body)
		}
		select {
		case <-stdinDone:
		case <-timeout:
			t.Fatalf("the command's stdin never ended for %q", body)
		}
		if cause := context.Cause(ctx); cause != nil {
			switch errdefs.KindOf(cause) {
			case errdefs.KindInvalid, errdefs.KindTooLarge, errdefs.KindCanceled:
			default:
				t.Fatalf("input %q cancelled the exec with %v (kind %q)", body, cause, errdefs.KindOf(cause))
			}
		}
	})
}

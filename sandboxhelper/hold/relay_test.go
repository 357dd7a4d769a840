package hold

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// relayOne sends a request and stdin to a relay and reads its frames
// up to the end.
func relayOne(t *testing.T, w io.Writer, r io.Reader, id, script string, stdin ...string) (out, errs string, end RelayEnd) {
	t.Helper()
	return relayRequest(t, w, r, RelayRequest{ID: id, Argv: []string{"sh", "-c", script}}, stdin...)
}

// relayRequest is relayOne with the whole request.
func relayRequest(t *testing.T, w io.Writer, r io.Reader, rr RelayRequest, stdin ...string) (out, errs string, end RelayEnd) {
	t.Helper()
	req, _ := json.Marshal(rr)
	frames := appendFrame(nil, FrameRequest, req)
	for _, s := range stdin {
		frames = appendFrame(frames, FrameIn, []byte(s))
	}
	frames = appendFrame(frames, FrameInEnd, nil)
	// Written while the frames are read: a pipe holds nothing, and the
	// relay may first be writing its own.
	wrote := make(chan error, 1)
	go func() {
		_, err := w.Write(frames)
		wrote <- err
	}()
	defer func() {
		if err := <-wrote; err != nil {
			t.Error(err)
		}
	}()
	var o, e bytes.Buffer
	buf := make([]byte, MaxRelayFrame)
	for {
		typ, p, err := readFrame(r, buf, MaxRelayFrame)
		if err != nil {
			t.Fatalf("read the relay's frame: %v (stdout %q, stderr %q)", err, o.String(), e.String())
		}
		switch typ {
		case FrameOut:
			o.Write(p)
		case FrameErr:
			e.Write(p)
		case FrameEnd:
			if err := json.Unmarshal(p, &end); err != nil {
				t.Fatal(err)
			}
			return o.String(), e.String(), end
		case FrameReady:
			// The relay's first frame (TestRelaySaysItServesThenRunsAnExchangeInItsProcess).
		default:
			t.Fatalf("a frame of type %q", typ)
		}
	}
}

// TestRelayRunsExecsInTurnOnceEachAndDropsAnEarlierExecsStdin: one relay
// runs one exec after another (kept by a keeper here: no server), each
// with its own stdin, output, and end naming it; stdin frames that come
// between two execs reach neither; a request for an id started before
// runs nothing again; the relay ends when its input does.
func TestRelayRunsExecsInTurnOnceEachAndDropsAnEarlierExecsStdin(t *testing.T) {
	h := newHolder(t)
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	wd := t.TempDir()
	ended := make(chan error, 1)
	go func() {
		err := (Options{}).Relay(context.Background(), h, inR, outW, os.Environ(), wd)
		outW.CloseWithError(fmt.Errorf("the relay ended: %v", err))
		inR.CloseWithError(fmt.Errorf("the relay ended: %v", err))
		ended <- err
	}()
	counter := filepath.Join(t.TempDir(), "ran")

	id1 := newID(t)
	out, errs, end := relayOne(t, inW, outR, id1, "echo ran >> "+counter+"; cat; pwd >&2; exit 3", "hel", "lo")
	if out != "hello" || errs != wd+"\n" || end != (RelayEnd{ID: id1, ExitCode: 3}) {
		t.Fatalf("first exec: stdout %q, stderr %q, end %+v", out, errs, end)
	}
	// Stdin of no exec: dropped, not the next one's.
	if _, err := inW.Write(appendFrame(appendFrame(nil, FrameIn, []byte("stale")), FrameInEnd, nil)); err != nil {
		t.Fatal(err)
	}
	id2 := newID(t)
	out, _, end = relayOne(t, inW, outR, id2, "cat", "fresh")
	if out != "fresh" || end != (RelayEnd{ID: id2, ExitCode: 0}) {
		t.Fatalf("second exec: stdout %q, end %+v; want only its own stdin", out, end)
	}
	out, errs, end = relayOne(t, inW, outR, id1, "echo ran >> "+counter)
	if end != (RelayEnd{ID: id1, ExitCode: ExitStarted}) || !strings.Contains(errs, "started before") {
		t.Fatalf("a request for an id started before: stdout %q, stderr %q, end %+v", out, errs, end)
	}
	if b, _ := os.ReadFile(counter); string(b) != "ran\n" {
		t.Fatalf("the first command ran %d times", strings.Count(string(b), "ran"))
	}
	inW.Close()
	select {
	case err := <-ended:
		if err != nil {
			t.Fatalf("the relay ended with %v at the end of its input", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the relay did not end with its input")
	}
}

// TestRelayForgetsTheExecsARequestNames: a request's Forget ids (execs
// whose end the daemon read) are removed from the holder, never the
// request's own or a running one; a malformed id ends the relay.
func TestRelayForgetsTheExecsARequestNames(t *testing.T) {
	h := newHolder(t)
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	ended := make(chan error, 1)
	go func() {
		err := (Options{}).Relay(context.Background(), h, inR, outW, os.Environ(), t.TempDir())
		outW.CloseWithError(fmt.Errorf("the relay ended: %v", err))
		inR.CloseWithError(fmt.Errorf("the relay ended: %v", err))
		ended <- err
	}()
	kept := func(id string) bool {
		_, err := os.Stat(filepath.Join(h.Root, id))
		return err == nil
	}
	id1, id2, id3 := newID(t), newID(t), newID(t)
	if _, _, end := relayOne(t, inW, outR, id1, "true"); end.ExitCode != 0 {
		t.Fatalf("first exec: %+v", end)
	}
	if !waitUntil(5*time.Second, func() bool { st, _ := h.State(id1); return st.Ended }) {
		t.Fatal("the first exec's status was not written")
	}
	if _, _, end := relayRequest(t, inW, outR, RelayRequest{ID: id2, Argv: []string{"true"}, Forget: []string{id1}}); end.ExitCode != 0 {
		t.Fatalf("second exec: %+v", end)
	}
	if !waitUntil(5*time.Second, func() bool { return !kept(id1) }) {
		t.Fatal("the exec the request named to forget is still kept")
	}
	if !kept(id2) {
		t.Fatal("the request's own exec is not kept")
	}
	req, _ := json.Marshal(RelayRequest{ID: id3, Argv: []string{"true"}, Forget: []string{"../x"}})
	if _, err := inW.Write(appendFrame(nil, FrameRequest, req)); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-ended:
		if err == nil || !strings.Contains(err.Error(), "forget") {
			t.Fatalf("the relay ended with %v at a malformed id to forget", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the relay went on after a malformed id to forget")
	}
	if kept(id3) || !kept(id2) {
		t.Fatalf("after the refused request: id3 kept %v, id2 kept %v", kept(id3), kept(id2))
	}
}

// waitUntil polls cond every 10 ms until it holds or d passes.
func waitUntil(d time.Duration, cond func() bool) bool {
	for deadline := time.Now().Add(d); ; time.Sleep(10 * time.Millisecond) {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}

// TestRelaySaysItServesThenRunsAnExchangeInItsProcess: the relay's first
// frame says it serves; an exchange request runs Options.Exchange in the
// relay's process with the request's frames as its input (the end of the
// input its end), its output and messages framed back and its code in
// the end; without Options.Exchange it is refused with a message; an
// exchange request that names a command ends the relay.
func TestRelaySaysItServesThenRunsAnExchangeInItsProcess(t *testing.T) {
	h := newHolder(t)
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	wd := t.TempDir()
	ended := make(chan error, 1)
	exchange := func(ctx context.Context, req RelayRequest, dir string, env []string, in io.Reader, out, log io.Writer) int {
		b, _ := io.ReadAll(in)
		fmt.Fprintf(out, "%s in %s, setup %q", strings.ToUpper(string(b)), dir, req.Setup)
		fmt.Fprint(log, "said")
		return 5
	}
	go func() {
		err := (Options{Exchange: exchange}).Relay(context.Background(), h, inR, outW, os.Environ(), wd)
		outW.CloseWithError(fmt.Errorf("the relay ended: %v", err))
		inR.CloseWithError(fmt.Errorf("the relay ended: %v", err))
		ended <- err
	}()
	buf := make([]byte, MaxRelayFrame)
	if typ, p, err := readFrame(outR, buf, MaxRelayFrame); err != nil || typ != FrameReady || len(p) != 0 {
		t.Fatalf("the relay's first frame: %q %q %v, want the ready frame", typ, p, err)
	}
	id := newID(t)
	out, errs, end := relayRequest(t, inW, outR, RelayRequest{ID: id, Exchange: true, Setup: "s"}, "fra", "mes")
	if want := "FRAMES in " + wd + `, setup "s"`; out != want || errs != "said" || end != (RelayEnd{ID: id, ExitCode: 5}) {
		t.Fatalf("the exchange: stdout %q, stderr %q, end %+v; want %q, said, 5", out, errs, end, want)
	}
	// A relay that cannot: it says so and nothing runs.
	r2, w2 := io.Pipe()
	o2r, o2w := io.Pipe()
	go func() {
		err := (Options{}).Relay(context.Background(), h, r2, o2w, os.Environ(), wd)
		o2w.CloseWithError(fmt.Errorf("the relay ended: %v", err))
	}()
	defer w2.Close()
	_, errs, end = relayRequest(t, w2, o2r, RelayRequest{ID: id, Exchange: true})
	if end.ExitCode != ExitFailed || !strings.Contains(errs, "no exchange") {
		t.Fatalf("an exchange on a relay without one: stderr %q, end %+v", errs, end)
	}
	req, _ := json.Marshal(RelayRequest{ID: newID(t), Exchange: true, Argv: []string{"true"}})
	if _, err := inW.Write(appendFrame(nil, FrameRequest, req)); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-ended:
		if err == nil || !strings.Contains(err.Error(), "names a command") {
			t.Fatalf("the relay ended with %v at an exchange naming a command", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the relay went on after an exchange naming a command")
	}
}

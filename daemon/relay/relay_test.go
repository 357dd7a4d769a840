package relay

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/binary"
	"encoding/pem"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/internal/helperproto"
	"github.com/sandboxd/sandboxd/localcloud/agent"
	"golang.org/x/crypto/ssh"
)

// TestRelayReaderRefusesForgedAndOversizedFrames: the daemon's reader of
// the relay's frames takes the output and an end that names the exec with
// an exit code 0..255, and refuses, as a forged answer (the relay is then
// closed and the command not run again), a data frame past 32 KiB, an
// end past 1 KiB, an end of another exec, an exit code out of range, an
// unreadable end and a frame of another type.
func TestRelayReaderRefusesForgedAndOversizedFrames(t *testing.T) {
	const id = "0123456789abcdef0123456789abcdef"
	frame := helperproto.AppendHoldFrame
	var out, errs bytes.Buffer
	good := frame(frame(frame(nil, helperproto.HoldOut, []byte("out")), helperproto.HoldErr, []byte("err")), helperproto.HoldEnd, []byte(`{"id":"`+id+`","exit_code":7}`))
	st, err := readRelay(bytes.NewReader(good), id, &out, &errs)
	if err != nil || st.Code != 7 || out.String() != "out" || errs.String() != "err" {
		t.Fatalf("a well-formed exec: %+v, %v, stdout %q, stderr %q", st, err, out.String(), errs.String())
	}
	oversized := func(typ byte, n int) []byte {
		b := []byte{typ, 0, 0, 0, 0}
		binary.BigEndian.PutUint32(b[1:], uint32(n))
		return append(b, make([]byte, n)...)
	}
	for name, b := range map[string][]byte{
		"a data frame past 32 KiB": oversized(helperproto.HoldOut, 32<<10+1),
		"a length of 4 GiB":        {helperproto.HoldErr, 0xff, 0xff, 0xff, 0xff},
		"an end past 1 KiB":        frame(nil, helperproto.HoldEnd, []byte(`{"id":"`+id+`","exit_code":0,"x":"`+strings.Repeat("a", 1<<10)+`"}`)),
		"an end of another exec":   frame(nil, helperproto.HoldEnd, []byte(`{"id":"ffffffffffffffffffffffffffffffff","exit_code":0}`)),
		"an end without an id":     frame(nil, helperproto.HoldEnd, []byte(`{"exit_code":0}`)),
		"an exit code of 256":      frame(nil, helperproto.HoldEnd, []byte(`{"id":"`+id+`","exit_code":256}`)),
		"a negative exit code":     frame(nil, helperproto.HoldEnd, []byte(`{"id":"`+id+`","exit_code":-1}`)),
		"an unreadable end":        frame(nil, helperproto.HoldEnd, []byte(`{"id":`)),
		"a frame of another type":  frame(nil, 'q', nil),
		"a request back":           frame(nil, helperproto.HoldRequest, []byte(`{}`)),
	} {
		_, err := readRelay(bytes.NewReader(append(frame(nil, helperproto.HoldOut, []byte("x")), b...)), id, &out, &errs)
		if !errors.Is(err, ErrForged) {
			t.Errorf("%s: %v, want it refused as forged", name, err)
		}
	}
	// A channel that ends before the end is a lost relay, not a forged one.
	if _, err := readRelay(bytes.NewReader(frame(nil, helperproto.HoldOut, []byte("x"))), id, &out, &errs); err == nil || errors.Is(err, ErrForged) {
		t.Errorf("a relay that ends before the end: %v, want a read error", err)
	}
}

// relayHelper is the name of the fake helper the relay tests install.
const relayHelper = "sandboxd-helper-0123456789abcdef"

// startRelayAgent runs a real agent whose workspace has script as the
// sandbox helper, and returns a slot and a connection to it.
func startRelayAgent(t *testing.T, script string) (*Slot, *sshpool.Conn) {
	t.Helper()
	dir := t.TempDir()
	bin := filepath.Join(dir, ".git", "sandboxd", "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bin, relayHelper), []byte("#!/bin/sh\n"+script), 0o755); err != nil {
		t.Fatal(err)
	}
	_, hostPriv, _ := ed25519.GenerateKey(rand.Reader)
	host, err := ssh.NewSignerFromKey(hostPriv)
	if err != nil {
		t.Fatal(err)
	}
	userPub, userPriv, _ := ed25519.GenerateKey(rand.Reader)
	block, err := ssh.MarshalPrivateKey(userPriv, "")
	if err != nil {
		t.Fatal(err)
	}
	authorized, err := ssh.NewPublicKey(userPub)
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.Start(agent.Config{HostKey: host, AuthorizedKey: authorized, Workspace: dir, Env: []string{"PATH=/usr/bin:/bin"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	target := sshpool.Target{RunID: "run-relay", Address: a.Addr(), PublicHostKey: string(ssh.MarshalAuthorizedKey(host.PublicKey())), PrivateUserKey: string(pem.EncodeToMemory(block))}
	pool := sshpool.New(sshpool.Options{})
	t.Cleanup(func() { pool.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pool.NewLink(nil).Get(ctx, target)
	if err != nil {
		t.Fatal(err)
	}
	slot := NewSlot(slog.New(slog.NewTextHandler(io.Discard, nil)))
	t.Cleanup(slot.Close)
	return slot, conn
}

// TestRelayClosesWhenIdleAndWithItsController: a relay is handed to one
// exec at a time; once idle for its bound it is closed (its channel's
// exec returns); the next exec opens a new one, which the slot's close
// (the controller's end) closes and joins.
func TestRelayClosesWhenIdleAndWithItsController(t *testing.T) {
	c, conn := startRelayAgent(t, `[ "$1 $2" = "hold relay" ] || exit 2; cat >/dev/null`)
	r := c.For(conn, relayHelper, time.Hour, false)
	if r == nil {
		t.Fatal("no relay on a fresh connection")
	}
	if again := c.For(conn, relayHelper, time.Hour, false); again != nil {
		t.Fatal("a busy relay was handed to a second exec")
	}
	r.done(false, 200*time.Millisecond)
	select {
	case <-r.ended:
	case <-time.After(10 * time.Second):
		t.Fatal("the relay was not closed within 10 s of an idle bound of 200 ms")
	}
	if errors.Is(r.err, sshpool.ErrConnectionLost) {
		t.Fatalf("the idle relay ended with %v", r.err)
	}
	r2 := c.For(conn, relayHelper, time.Hour, false)
	if r2 == nil || r2 == r {
		t.Fatal("the exec after an idle close got no new relay")
	}
	r2.done(false, time.Hour)
	c.Close()
	select {
	case <-r2.ended:
	default:
		t.Fatal("the controller ended with its relay still open")
	}
}

// TestRelayAnsweringGarbageIsClosedAndTheExecReported: a relay (here a
// process of the sandbox posing as one) whose answer is not a relay's is
// closed and its exec ends with ErrForged, which the daemon reports
// without running the command again.
func TestRelayAnsweringGarbageIsClosedAndTheExecReported(t *testing.T) {
	c, conn := startRelayAgent(t, `head -c 5 >/dev/null; printf 'o\000\000\000\003out'; printf 'x\000\000\000\002{}'; cat >/dev/null`)
	r := c.For(conn, relayHelper, time.Hour, false)
	if r == nil {
		t.Fatal("no relay on a fresh connection")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out bytes.Buffer
	const id = "0123456789abcdef0123456789abcdef"
	_, err := r.Run(ctx, Call{Req: helperproto.RelayRequest{ID: id, Argv: []string{"true"}}, Feed: func(io.Writer) {}, CutStdin: func() {}, Stdout: &out, Stderr: &out, Hold: id, SignalTimeout: time.Second, Idle: time.Hour})
	if !errors.Is(err, ErrForged) {
		t.Fatalf("the exec on a relay that answered an end without an id: %v, want ErrForged", err)
	}
	select {
	case <-r.ended:
	case <-time.After(10 * time.Second):
		t.Fatal("the relay that answered garbage was not closed")
	}
	if again := c.For(conn, relayHelper, time.Hour, false); again == r {
		t.Fatal("the relay that answered garbage was used again")
	}
	// The next relay answers the same garbage unasked: the controller's
	// end closes it without reading it, and is not held up.
	began := time.Now()
	c.Close()
	if d := time.Since(began); d > CloseGrace {
		t.Errorf("the controller's end took %s with a relay that wrote unread frames", d)
	}
}

// TestAnExchangesOpeningGoesInFramesWithinTheRelaysBound: an opening of
// megabytes (a request carrying a large patch) travels as 'i' frames of
// at most 32 KiB, which the relay takes, in order and whole.
func TestAnExchangesOpeningGoesInFramesWithinTheRelaysBound(t *testing.T) {
	opening := bytes.Repeat([]byte("0123456789"), 300_000)
	r := bytes.NewReader(inFrames(opening))
	var got []byte
	buf := make([]byte, helperproto.MaxHoldFrame)
	for r.Len() > 0 {
		typ, p, err := helperproto.ReadHoldFrame(r, buf, helperproto.MaxHoldFrame)
		if err != nil || typ != helperproto.HoldIn {
			t.Fatalf("frame %q: %v", typ, err)
		}
		got = append(got, p...)
	}
	if !bytes.Equal(got, opening) {
		t.Fatalf("the frames carry %d bytes, want the opening's %d", len(got), len(opening))
	}
}

// TestRelayThatSaysNothingHoldsAnExecOnlyForItsBound: a file of the
// sandbox in the helper's place that takes the request and says nothing
// (no ready frame, the channel open) is cut at the ready bound, and the
// exec ends as lost (the daemon then asks the holder, and runs nothing
// again); when the caller ends first, the exec ends with it.
func TestRelayThatSaysNothingHoldsAnExecOnlyForItsBound(t *testing.T) {
	const id = "0123456789abcdef0123456789abcdef"
	call := Call{Req: helperproto.RelayRequest{ID: id, Argv: []string{"true"}}, Feed: func(io.Writer) {}, CutStdin: func() {}, Stdout: io.Discard, Stderr: io.Discard, Hold: id, SignalTimeout: time.Second, Idle: time.Hour}
	c, conn := startRelayAgent(t, `cat >/dev/null`)
	c.readyWait = 300 * time.Millisecond
	r := c.For(conn, relayHelper, time.Hour, false)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	began := time.Now()
	_, err := r.Run(ctx, call)
	if took := time.Since(began); !errors.Is(err, ErrLost) || took > 20*time.Second {
		t.Fatalf("an exec on a relay that says nothing: %v after %s, want ErrLost within 20 s", err, took)
	}
	c.readyWait = time.Minute
	r = c.For(conn, relayHelper, time.Hour, false)
	cctx, ccancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer ccancel()
	began = time.Now()
	_, err = r.Run(cctx, call)
	if took := time.Since(began); !errors.Is(err, context.DeadlineExceeded) || took > 5*time.Second {
		t.Fatalf("a cancelled exec on a relay that says nothing: %v after %s, want the caller's end within 5 s", err, took)
	}
}

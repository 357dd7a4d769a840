package forward

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
)

// echoServer is a TCP echo server standing in for the sandbox's port.
func echoServer(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); _, _ = io.Copy(c, c) }()
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port
}

// dialer reaches the echo server directly, counting dials; fail makes it
// refuse (a sandbox that cannot be reached).
type dialer struct {
	dials atomic.Int32
	fail  atomic.Bool
}

func (d *dialer) DialSandbox(ctx context.Context, runID string, port int) (net.Conn, error) {
	d.dials.Add(1)
	if d.fail.Load() {
		return nil, errors.New("sandbox unreachable")
	}
	var nd net.Dialer
	return nd.DialContext(ctx, "tcp", fmt.Sprintf("127.0.0.1:%d", port))
}

func roundTrip(t *testing.T, port int, msg string) error {
	t.Helper()
	c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 5*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		return err
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	if string(buf) != msg {
		return fmt.Errorf("got %q, want %q", buf, msg)
	}
	return nil
}

func TestForwardCarriesConnectionsUntilClosed(t *testing.T) {
	target := echoServer(t)
	d := &dialer{}
	m := New(Options{Dialer: d})
	defer m.Shutdown()
	r1 := m.NewSet()
	info, err := r1.Open(Spec{RunID: "r1", Name: "web", TargetPort: target})
	if err != nil {
		t.Fatal(err)
	}
	if info.LocalPort == 0 || info.URL() != fmt.Sprintf("http://127.0.0.1:%d", info.LocalPort) {
		t.Fatalf("info %+v", info)
	}
	if err := roundTrip(t, info.LocalPort, "hello"); err != nil {
		t.Fatal(err)
	}
	// A sandbox that cannot be reached costs that connection only.
	d.fail.Store(true)
	if err := roundTrip(t, info.LocalPort, "x"); err == nil {
		t.Fatal("a connection went through while the sandbox was unreachable")
	}
	d.fail.Store(false)
	if err := roundTrip(t, info.LocalPort, "again"); err != nil {
		t.Fatalf("after the sandbox came back: %v", err)
	}
	// Opening the same again keeps it; a different target replaces it.
	same, err := r1.Open(Spec{RunID: "r1", Name: "web", TargetPort: target})
	if err != nil || same.LocalPort != info.LocalPort {
		t.Fatalf("reopen: %+v, %v", same, err)
	}
	if got := r1.List(); len(got) != 1 || got[0].Name != "web" {
		t.Fatalf("list: %+v", got)
	}
	// An open connection is ended with its forward.
	c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", info.LocalPort))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("hi")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 2)
	if _, err := io.ReadFull(c, buf); err != nil {
		t.Fatal(err)
	}
	closed := r1.CloseAll()
	if len(closed) != 1 {
		t.Fatalf("CloseAll closed %+v", closed)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(buf); err == nil {
		t.Fatal("a forwarded connection outlived its forward")
	}
	if _, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", info.LocalPort), time.Second); err == nil {
		t.Fatal("the local port still accepts after CloseAll")
	}
	if len(r1.List()) != 0 {
		t.Fatal("forwards left after CloseAll")
	}
}

func TestPortInUseNamesItsHolder(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	m := New(Options{Dialer: &dialer{}})
	defer m.Shutdown()
	r1, r2 := m.NewSet(), m.NewSet()
	_, err = r1.Open(Spec{RunID: "r1", Name: "web", TargetPort: 80, LocalPort: port})
	if errdefs.KindOf(err) != errdefs.KindConflict {
		t.Fatalf("open on a taken port: %v (kind %s), want a conflict", err, errdefs.KindOf(err))
	}
	want := fmt.Sprintf("pid %d (", os.Getpid())
	if !strings.Contains(err.Error(), fmt.Sprintf("local port %d is already in use by %s", port, want)) || !strings.Contains(err.Error(), "--local-port") {
		t.Fatalf("error %q does not name the holder %q and the fix", err, want)
	}
	// A port held by another forward of ours names that forward.
	info, err := r1.Open(Spec{RunID: "r1", Name: "api", TargetPort: 81})
	if err != nil {
		t.Fatal(err)
	}
	_, err = r2.Open(Spec{RunID: "r2", Name: "web", TargetPort: 80, LocalPort: info.LocalPort})
	if errdefs.KindOf(err) != errdefs.KindConflict || !strings.Contains(err.Error(), `forward "api" of run r1`) {
		t.Fatalf("open on our own forward's port: %v", err)
	}
}

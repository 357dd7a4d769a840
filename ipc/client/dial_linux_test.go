package client

import (
	"context"
	"errors"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// A daemon whose listen backlog is full makes the connect wait: dialUnix
// waits at most its timeout (or the context), and connects once the
// daemon takes the connection.
func TestDialWaitsForAFullBacklog(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s.sock")
	lfd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(lfd)
	if err := syscall.Bind(lfd, &syscall.SockaddrUnix{Name: sock}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(lfd, 0); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	// Fill the backlog (0 takes one pending connection).
	pending := 0
	for i := 0; i < 4; i++ {
		f, err := dialUnix(ctx, sock, 50*time.Millisecond)
		if err != nil {
			break
		}
		pending++
		defer f.Close()
	}
	start := time.Now()
	_, err = dialUnix(ctx, sock, 200*time.Millisecond)
	if !errors.Is(err, syscall.ETIMEDOUT) {
		t.Fatalf("dial to a full backlog: %v, want a time-out", err)
	}
	if took := time.Since(start); took < 150*time.Millisecond || took > 5*time.Second {
		t.Fatalf("the time-out came after %v", took)
	}
	ctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := dialUnix(ctx, sock, time.Minute); !errors.Is(err, context.Canceled) {
		t.Fatalf("dial with an ended context: %v", err)
	}
	// The daemon takes the pending connections: the next dial gets in.
	go func() {
		for {
			nfd, _, err := syscall.Accept(lfd)
			if err != nil {
				return
			}
			defer syscall.Close(nfd)
		}
	}()
	f, err := dialUnix(context.Background(), sock, 5*time.Second)
	if err != nil {
		t.Fatalf("dial once the daemon accepts: %v", err)
	}
	f.Close()
	if pending == 0 {
		t.Fatal("no connection was pending")
	}
}

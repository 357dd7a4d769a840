package client

import (
	"context"
	"errors"
	"fmt"
	"net"
	"syscall"
	"time"
)

// dialUnix connects to the Unix socket at path. A Unix socket's connect
// never completes later: EAGAIN says the daemon's backlog is full and
// nothing happened, so it is tried again, a little later each time, until
// ctx ends or timeout passes.
func dialUnix(parent context.Context, path string, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(parent, timeout)
	defer cancel()
	var d net.Dialer
	wait := time.Millisecond
	for {
		conn, err := d.DialContext(ctx, "unix", path)
		if err == nil || !errors.Is(err, syscall.EAGAIN) {
			return conn, err
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			if parent.Err() != nil {
				return nil, parent.Err()
			}
			return nil, fmt.Errorf("sandboxd did not take the connection within %s (its listen backlog stayed full: is it overloaded?): %w", timeout, syscall.ETIMEDOUT)
		case <-t.C:
		}
		wait = min(2*wait, 50*time.Millisecond)
	}
}

package sshpool

import (
	"context"
	"fmt"
	"net"
)

// Dial opens a TCP connection to addr as the sandbox sees it (a
// direct-tcpip channel on this connection: no new handshake). The returned
// connection ends with the SSH connection; ctx bounds only the open.
func (c *Conn) Dial(ctx context.Context, addr string) (net.Conn, error) {
	if !c.alive() {
		return nil, fmt.Errorf("reach %s in sandbox %s: %w", addr, c.target.RunID, ErrNotSent)
	}
	done := make(chan dialResult, 1)
	go func() {
		nc, err := c.client.Dial("tcp", addr)
		done <- dialResult{nc, err}
	}()
	select {
	case r := <-done:
		if r.err != nil {
			return nil, fmt.Errorf("reach %s in sandbox %s: %w", addr, c.target.RunID, r.err)
		}
		return r.nc, nil
	case <-ctx.Done():
		discard(done)
		return nil, fmt.Errorf("reach %s in sandbox %s: %w", addr, c.target.RunID, ctx.Err())
	case <-c.done:
		discard(done)
		return nil, fmt.Errorf("reach %s in sandbox %s: %w", addr, c.target.RunID, ErrConnectionLost)
	}
}

// discard closes a connection whose open finished after its caller left.
func discard(done <-chan dialResult) {
	go func() {
		if nc := (<-done).nc; nc != nil {
			nc.Close()
		}
	}()
}

type dialResult struct {
	nc  net.Conn
	err error
}

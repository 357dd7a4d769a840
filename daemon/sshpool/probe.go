package sshpool

import (
	"context"
	"fmt"
	"time"
)

// Probe asks the agent for a sign of life (a keepalive) and waits at most
// timeout for it. A connection that went silent (the laptop slept, the
// network changed) looks open until the next keepalive times out; a caller
// about to wait on it probes instead. No answer in time closes the
// connection, as the keepalive would later, and the error wraps
// ErrKeepaliveTimeout; so does an answer that cannot come because the
// connection broke. A context that ends first leaves it open.
func (c *Conn) Probe(ctx context.Context, timeout time.Duration) error {
	reply := make(chan error, 1)
	go func() {
		// Any answer, even a refusal, proves the peer is alive.
		_, _, err := c.client.SendRequest("keepalive@openssh.com", true, nil)
		reply <- err
	}()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case err := <-reply:
		if err != nil {
			c.close(fmt.Errorf("keepalive failed: %w", err))
			return fmt.Errorf("%w: %w", ErrKeepaliveTimeout, err)
		}
		return nil
	case <-t.C:
		err := fmt.Errorf("%w (a probe got no answer within %s)", ErrKeepaliveTimeout, timeout)
		c.close(err)
		return err
	case <-c.done:
		c.mu.Lock()
		err := c.err
		c.mu.Unlock()
		return fmt.Errorf("%w: %w", ErrKeepaliveTimeout, err)
	case <-ctx.Done():
		return ctx.Err()
	}
}

// ProbeAll probes every open connection at once, for when they may all
// have gone silent without a sign (the machine slept, its network
// changed): the silent ones are closed within timeout instead of at their
// keepalive timeout, and every kept sandbox reconnects without waiting for
// its backoff. It returns how many connections were found dead.
func (p *Pool) ProbeAll(ctx context.Context, timeout time.Duration) int {
	p.mu.Lock()
	conns := make([]*Conn, 0, len(p.conns))
	for c := range p.conns {
		conns = append(conns, c)
	}
	p.mu.Unlock()
	dead := make(chan bool, len(conns))
	for _, c := range conns {
		go func() {
			err := c.Probe(ctx, timeout)
			dead <- err != nil && ctx.Err() == nil
		}()
	}
	n := 0
	for range conns {
		if <-dead {
			n++
		}
	}
	p.mu.Lock()
	for e := range p.links {
		select {
		case e.wake <- struct{}{}:
		default:
		}
	}
	p.mu.Unlock()
	return n
}

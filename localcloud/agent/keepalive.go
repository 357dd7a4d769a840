package agent

import (
	"context"
	"time"

	"golang.org/x/crypto/ssh"
)

// Defaults of Config.KeepaliveInterval and KeepaliveCount: a client that
// answers none of three keepalives sent 5 s apart is gone, and what it
// held (the sandbox lock) goes to the next in line.
const (
	DefaultKeepaliveInterval = 5 * time.Second
	DefaultKeepaliveCount    = 3
)

// keepalive asks the client for a sign of life every interval, as OpenSSH's
// ClientAliveInterval does: a connection that went silent (a laptop that
// slept or changed networks) is not closed by TCP for a long time, and
// until it is, the lock it holds keeps every other client waiting. It
// closes conn once count intervals pass without an answer; any answer,
// even a refusal, is one.
func (a *Agent) keepalive(ctx context.Context, conn *ssh.ServerConn, id uint64) {
	interval, count := a.cfg.KeepaliveInterval, a.cfg.KeepaliveCount
	if interval < 0 {
		return
	}
	limit := interval * time.Duration(count)
	tick := time.NewTicker(interval)
	defer tick.Stop()
	dead := time.NewTimer(limit)
	defer dead.Stop()
	answers := make(chan struct{}, 1)
	outstanding := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-answers:
			outstanding = false
			dead.Reset(limit)
		case <-tick.C:
			if outstanding {
				continue // one request at a time: a silent client queues none
			}
			outstanding = true
			go func() {
				if _, _, err := conn.SendRequest("keepalive@openssh.com", true, nil); err == nil {
					answers <- struct{}{}
				}
			}()
		case <-dead.C:
			a.log.Info("closing a client connection that answered no keepalive", "conn", id, "silent_for", limit)
			conn.Close()
			return
		}
	}
}

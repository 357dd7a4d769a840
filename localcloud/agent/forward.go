package agent

import (
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"

	"golang.org/x/crypto/ssh"
)

// directTCPIP is the payload of a "direct-tcpip" channel open (RFC 4254
// section 7.2).
type directTCPIP struct {
	Host       string
	Port       uint32
	OriginHost string
	OriginPort uint32
}

// loopbackHost reports whether host names the sandbox's own loopback: the
// only place a port forward may reach (the agent must not become a proxy
// into the machine's network).
func loopbackHost(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// forward serves one direct-tcpip channel: a TCP connection to a port on
// the sandbox's loopback, spliced to the channel.
func (a *Agent) forward(nch ssh.NewChannel) {
	defer a.wg.Done()
	var req directTCPIP
	if err := ssh.Unmarshal(nch.ExtraData(), &req); err != nil {
		_ = nch.Reject(ssh.ConnectionFailed, "malformed direct-tcpip request")
		return
	}
	if !loopbackHost(req.Host) {
		_ = nch.Reject(ssh.Prohibited, fmt.Sprintf("only the sandbox's loopback can be reached (127.0.0.1, ::1, localhost), not %q", req.Host))
		return
	}
	if req.Port == 0 || req.Port > 65535 {
		_ = nch.Reject(ssh.ConnectionFailed, fmt.Sprintf("port %d is not a port", req.Port))
		return
	}
	host := req.Host
	if host == "localhost" {
		host = "127.0.0.1"
	}
	addr := net.JoinHostPort(host, strconv.Itoa(int(req.Port)))
	tc, err := a.dialTCP(addr)
	if err != nil {
		_ = nch.Reject(ssh.ConnectionFailed, fmt.Sprintf("connect to %s in the sandbox: %v", addr, err))
		return
	}
	ch, reqs, err := nch.Accept()
	if err != nil {
		tc.Close()
		return
	}
	go ssh.DiscardRequests(reqs)
	a.busy.Add(1)
	a.activity()
	defer func() {
		a.busy.Add(-1)
		a.activity()
	}()
	// Close both sides once the agent closes, so Close never waits on an
	// idle forwarded connection.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		select {
		case <-a.ctx.Done():
			ch.Close()
			tc.Close()
		case <-stop:
		}
	}()
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		_, _ = io.Copy(tc, ch)
		// The client finished sending: pass the half-close on.
		if c, ok := tc.(*net.TCPConn); ok {
			_ = c.CloseWrite()
		}
	}()
	go func() {
		defer wg.Done()
		_, _ = io.Copy(ch, tc)
		_ = ch.CloseWrite()
	}()
	wg.Wait()
	ch.Close()
	tc.Close()
}

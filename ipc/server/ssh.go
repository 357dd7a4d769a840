package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

func (s *Server) sshBackend() (SSHBackend, error) {
	if s.b.SSH == nil {
		return nil, errdefs.Unavailable(errors.New("SSH access is not available in this daemon: the daemon has not finished starting (or failed to); see `nook daemon status`"))
	}
	return s.b.SSH, nil
}

func getSSHHosts(b SSHBackend, ctx context.Context, _ struct{}) (ipc.SSHHostsResponse, error) {
	resp, err := b.SSHHosts(ctx)
	if err == nil && resp.Hosts == nil {
		resp.Hosts = []ipc.SSHHost{}
	}
	return resp, err
}

// postSSHProxy serves POST /v1/ssh/proxy: with "Connection: Upgrade" and
// "Upgrade: sandboxd-ssh", it connects to the sandbox's SSH server, answers
// 101 and splices the two connections until both directions end. A failure
// to connect is an ordinary JSON error.
func (s *Server) postSSHProxy(w http.ResponseWriter, r *http.Request) error {
	if !strings.EqualFold(r.Header.Get("Upgrade"), ipc.SSHProxyProtocol) {
		return errdefs.Invalidf("this route upgrades the connection: send \"Connection: Upgrade\" and \"Upgrade: %s\" (nook proxy --stdio HOST does)", ipc.SSHProxyProtocol)
	}
	req, err := jsonBody[ipc.SSHProxyRequest](r)
	if err != nil {
		return err
	}
	b, err := s.sshBackend()
	if err != nil {
		return err
	}
	agent, err := b.DialSSH(r.Context(), req)
	if err != nil {
		return err
	}
	defer agent.Close()
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return errdefs.Internal(fmt.Errorf("take over the connection for the SSH stream: %w", err))
	}
	defer conn.Close()
	defer s.trackStream()()
	if _, err := fmt.Fprintf(brw, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: %s\r\n%s: %s\r\n\r\n", ipc.SSHProxyProtocol, ipc.HeaderVersion, s.version); err != nil {
		return nil
	}
	if err := brw.Flush(); err != nil {
		return nil
	}
	// Bytes the client sent after its request are in the reader's buffer.
	var client io.Reader = conn
	if n := brw.Reader.Buffered(); n > 0 {
		head, _ := brw.Reader.Peek(n)
		client = io.MultiReader(strings.NewReader(string(head)), conn)
	}
	splice(agent, conn, client)
	return nil
}

// splice copies both ways until both directions end, passing on each
// direction's end as a half-close.
func splice(agent, conn net.Conn, client io.Reader) {
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		_, _ = io.Copy(agent, client)
		closeWrite(agent)
	}()
	go func() {
		defer wg.Done()
		_, _ = io.Copy(conn, agent)
		closeWrite(conn)
	}()
	wg.Wait()
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		return
	}
	_ = c.Close()
}

package ipc

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
)

// SSHBackend gives OpenSSH (and what runs over it: scp, rsync, git,
// editors' Remote-SSH) a way to the sandboxes through the daemon.
type SSHBackend interface {
	// SSHHosts writes the files OpenSSH needs for each live sandbox (its
	// pinned host key, its user key, 0600 under the daemon's state
	// directory) and describes them.
	SSHHosts(ctx context.Context) (SSHHostsResponse, error)
	// DialSSH connects to the SSH server of the sandbox req names.
	DialSSH(ctx context.Context, req SSHProxyRequest) (net.Conn, error)
}

// SSHHost is one sandbox as an OpenSSH host.
type SSHHost struct {
	// Name is the host name for ssh: "sbx-<repo>-<branch>", unique among
	// the live sandboxes.
	Name           string `json:"name"`
	RunID          string `json:"runId"`
	RepoRoot       string `json:"repoRoot"`
	Branch         string `json:"branch"`
	User           string `json:"user"`
	IdentityFile   string `json:"identityFile"`
	KnownHostsFile string `json:"knownHostsFile"`
	// HostKeyAlias is the name the host key is pinned under in
	// KnownHostsFile.
	HostKeyAlias string `json:"hostKeyAlias"`
}

// SSHHostsResponse answers GET /v1/ssh/hosts.
type SSHHostsResponse struct {
	Hosts    []SSHHost `json:"hosts"`
	Warnings []string  `json:"warnings,omitempty"`
}

// SSHProxyRequest is the body of POST /v1/ssh/proxy: a host name from
// SSHHosts ("sbx-..."), or a target.
type SSHProxyRequest struct {
	Host string `json:"host,omitempty"`
	Target
}

// Validate checks a proxy request: a host or a target.
func (r *SSHProxyRequest) Validate() error {
	if r.Host != "" {
		if strings.ContainsAny(r.Host, "/\x00 ") {
			return errdefs.Invalidf("host %q is not a sandbox host name: use a name from `sbx ssh-config`", r.Host)
		}
		return nil
	}
	return r.Target.Validate()
}

// SSHProxyProtocol is the Upgrade token of POST /v1/ssh/proxy: after the
// 101 answer the connection carries the SSH stream to the sandbox.
const SSHProxyProtocol = "sandboxd-ssh"

func (s *Server) sshBackend() (SSHBackend, error) {
	if s.b.SSH == nil {
		return nil, errdefs.Unavailable(errors.New("SSH access is not available in this daemon: the daemon has not finished starting (or failed to); see `sbx daemon status`"))
	}
	return s.b.SSH, nil
}

func getSSHHosts(b SSHBackend, ctx context.Context, _ struct{}) (SSHHostsResponse, error) {
	resp, err := b.SSHHosts(ctx)
	if err == nil && resp.Hosts == nil {
		resp.Hosts = []SSHHost{}
	}
	return resp, err
}

// postSSHProxy serves POST /v1/ssh/proxy: with "Connection: Upgrade" and
// "Upgrade: sandboxd-ssh", it connects to the sandbox's SSH server, answers
// 101 and splices the two connections until both directions end. A failure
// to connect is an ordinary JSON error.
func (s *Server) postSSHProxy(w http.ResponseWriter, r *http.Request) error {
	if !strings.EqualFold(r.Header.Get("Upgrade"), SSHProxyProtocol) {
		return errdefs.Invalidf("this route upgrades the connection: send \"Connection: Upgrade\" and \"Upgrade: %s\" (sbx proxy --stdio HOST does)", SSHProxyProtocol)
	}
	req, err := jsonBody[SSHProxyRequest](r)
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
	if _, err := fmt.Fprintf(brw, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: %s\r\n%s: %s\r\n\r\n", SSHProxyProtocol, HeaderVersion, s.version); err != nil {
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

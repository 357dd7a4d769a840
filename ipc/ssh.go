package ipc

import (
	"strings"

	"github.com/sandboxd/sandboxd/errdefs"
)

// SSHHost is one sandbox as an OpenSSH host.
type SSHHost struct {
	// Name is the host name for ssh: "nook-<repo>-<branch>", unique among
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
// SSHHosts ("nook-..."), or a target.
type SSHProxyRequest struct {
	Host string `json:"host,omitempty"`
	Target
}

// Validate checks a proxy request: a host or a target.
func (r *SSHProxyRequest) Validate() error {
	if r.Host != "" {
		if strings.ContainsAny(r.Host, "/\x00 ") {
			return errdefs.Invalidf("host %q is not a sandbox host name: use a name from `nook ssh-config`", r.Host)
		}
		return nil
	}
	return r.Target.Validate()
}

// SSHProxyProtocol is the Upgrade token of POST /v1/ssh/proxy: after the
// 101 answer the connection carries the SSH stream to the sandbox.
const SSHProxyProtocol = "sandboxd-ssh"

package sessions

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/backend"
	"github.com/sandboxd/sandboxd/store"
)

// sshUser is the user OpenSSH logs in as: the one the daemon's own
// connections use (sshpool's default, today's RWX CLI's).
const sshUser = "rwx-cli"

// sshDialTimeout bounds connecting to a sandbox's SSH server.
const sshDialTimeout = 10 * time.Second

var _ backend.SSHBackend = (*Manager)(nil)

// sshHost is a live session that OpenSSH can reach.
type sshHost struct {
	name string
	s    *store.Session
}

// sshHosts names the ready sessions: "nook-<repo>-<branch>" (plus the config
// when it is not the default one), with the run id's start added where two
// would share a name. The order is stable.
func (m *Manager) sshHosts() ([]sshHost, error) {
	all, err := m.st.List()
	if err != nil {
		return nil, err
	}
	var hosts []sshHost
	count := map[string]int{}
	for _, s := range all {
		if s.State.Terminal() || s.RunID == "" || s.Address == "" || s.PrivateUserKey == "" || s.PublicHostKey == "" {
			continue
		}
		base := "nook-" + hostLabel(filepath.Base(s.RepoRoot))
		if s.RepoRoot == "" {
			base = "nook-" + hostLabel(s.RunID)
		} else if s.Branch != "" {
			base += "-" + hostLabel(s.Branch)
		}
		if cfg := filepath.Base(s.ConfigFile); s.ConfigFile != "" && cfg != "sandbox.yml" {
			base += "-" + hostLabel(strings.TrimSuffix(strings.TrimSuffix(cfg, ".yml"), ".yaml"))
		}
		hosts = append(hosts, sshHost{name: base, s: s})
		count[base]++
	}
	for i := range hosts {
		if count[hosts[i].name] > 1 {
			hosts[i].name += "-" + hostLabel(hosts[i].s.RunID[:min(8, len(hosts[i].s.RunID))])
		}
	}
	sort.Slice(hosts, func(i, j int) bool { return hosts[i].name < hosts[j].name })
	return hosts, nil
}

// hostLabel makes s usable in a host name: lower case letters, digits,
// dots and dashes.
func hostLabel(s string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(s) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9', r == '.', r == '-':
			b.WriteRune(r)
		default:
			b.WriteByte('-')
		}
	}
	return strings.Trim(b.String(), "-.")
}

// SSHHosts writes the key files of each ready session and describes them.
func (m *Manager) SSHHosts(ctx context.Context) (ipc.SSHHostsResponse, error) {
	if m.opts.SSHDir == "" {
		return ipc.SSHHostsResponse{}, errdefs.Unavailable(errors.New("SSH access is not configured in this daemon (no state directory)"))
	}
	hosts, err := m.sshHosts()
	if err != nil {
		return ipc.SSHHostsResponse{}, err
	}
	resp := ipc.SSHHostsResponse{Hosts: []ipc.SSHHost{}}
	for _, h := range hosts {
		host, err := m.writeSSHFiles(h)
		if err != nil {
			resp.Warnings = append(resp.Warnings, fmt.Sprintf("%s (run %s) left out: %v", h.name, h.s.RunID, err))
			continue
		}
		resp.Hosts = append(resp.Hosts, host)
	}
	return resp, nil
}

// writeSSHFiles writes the session's user key (OpenSSH format) and pinned
// host key, each 0600 in a 0700 directory of its run.
func (m *Manager) writeSSHFiles(h sshHost) (ipc.SSHHost, error) {
	dir := filepath.Join(m.opts.SSHDir, hostLabel(h.s.RunID))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return ipc.SSHHost{}, fmt.Errorf("create %s: %w", dir, err)
	}
	key, err := ssh.ParseRawPrivateKey([]byte(h.s.PrivateUserKey))
	if err != nil {
		return ipc.SSHHost{}, fmt.Errorf("read the run's user key: %w", err)
	}
	block, err := ssh.MarshalPrivateKey(key, "")
	if err != nil {
		return ipc.SSHHost{}, fmt.Errorf("encode the run's user key for OpenSSH: %w", err)
	}
	hostKey, _, _, _, err := ssh.ParseAuthorizedKey([]byte(h.s.PublicHostKey))
	if err != nil {
		return ipc.SSHHost{}, fmt.Errorf("read the sandbox's host key: %w", err)
	}
	alias := "nook-" + hostLabel(h.s.RunID)
	out := ipc.SSHHost{
		Name: h.name, RunID: h.s.RunID, RepoRoot: h.s.RepoRoot, Branch: h.s.Branch, User: sshUser,
		IdentityFile:   filepath.Join(dir, "id"),
		KnownHostsFile: filepath.Join(dir, "known_hosts"),
		HostKeyAlias:   alias,
	}
	if err := writeFileAtomic(out.IdentityFile, pem.EncodeToMemory(block)); err != nil {
		return ipc.SSHHost{}, err
	}
	known := alias + " " + strings.TrimSpace(string(ssh.MarshalAuthorizedKey(hostKey))) + "\n"
	if err := writeFileAtomic(out.KnownHostsFile, []byte(known)); err != nil {
		return ipc.SSHHost{}, err
	}
	return out, nil
}

// writeFileAtomic writes a 0600 file by renaming a complete temporary one
// over it: OpenSSH reading it meanwhile sees the old or the new content.
func writeFileAtomic(path string, data []byte) error {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	tmp := path + ".tmp-" + hex.EncodeToString(b)
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// DialSSH connects to the SSH server of the sandbox a proxy request names:
// a host name from SSHHosts, or a target.
func (m *Manager) DialSSH(ctx context.Context, req ipc.SSHProxyRequest) (net.Conn, error) {
	var s *store.Session
	if req.Host != "" {
		hosts, err := m.sshHosts()
		if err != nil {
			return nil, err
		}
		for _, h := range hosts {
			if h.name == req.Host || "nook-"+hostLabel(h.s.RunID) == req.Host {
				s = h.s
				break
			}
		}
		if s == nil {
			return nil, errdefs.NotFoundf("no live sandbox is called %s: `nook ssh-config` lists the current ones (a sandbox that was stopped or reset has a new name or none)", req.Host)
		}
	} else {
		var err error
		if s, _, err = m.lookupBranch(ctx, req.Target); err != nil {
			return nil, err
		}
		if s.State.Terminal() || s.Address == "" {
			return nil, errdefs.Conflictf("the sandbox of run %s is not ready (%s): start it with `nook start --wait`", s.RunID, s.State)
		}
	}
	d := net.Dialer{Timeout: sshDialTimeout}
	conn, err := d.DialContext(ctx, "tcp", s.Address)
	if err != nil {
		return nil, errdefs.Unavailable(fmt.Errorf("connect to the SSH server of sandbox %s at %s: %w (check it with `nook status`)", s.RunID, s.Address, err))
	}
	// An open SSH session (ssh, scp, an editor's remote) keeps the sandbox
	// from the idle stop until it closes.
	return &heldConn{Conn: conn, release: m.hold(s.ID)}, nil
}

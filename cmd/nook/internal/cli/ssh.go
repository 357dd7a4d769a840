package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// sshConfig is `nook ssh-config`: an OpenSSH config block per live sandbox,
// reaching it through `nook proxy --stdio` with the pinned host key and the
// run's key (files the daemon writes), never a prompt.
func (a *app) sshConfig(ctx context.Context) int {
	var resp ipc.SSHHostsResponse
	if err := a.call(ctx, func(ctx context.Context) (err error) { resp, err = a.c.SSHHosts(ctx); return err }); err != nil {
		return a.fail(err)
	}
	for _, w := range resp.Warnings {
		a.warn(w)
	}
	if a.p.json() {
		return a.printJSON(resp)
	}
	self, err := os.Executable()
	if err != nil {
		self = "nook"
	}
	if len(resp.Hosts) == 0 {
		fmt.Fprintln(a.sys.Stdout, "# no live sandbox: start one with `nook start --wait`, then run nook ssh-config again")
		return ExitOK
	}
	fmt.Fprintf(a.sys.Stdout, "# sandboxd: the live sandboxes (regenerate after start/reset: nook ssh-config > ~/.ssh/nook.config, Include it from ~/.ssh/config)\n")
	for _, h := range resp.Hosts {
		fmt.Fprintf(a.sys.Stdout, "\n# %s, branch %s (run %s)\n", h.RepoRoot, h.Branch, h.RunID)
		fmt.Fprintf(a.sys.Stdout, "Host %s %s\n", h.Name, h.HostKeyAlias)
		for _, kv := range [][2]string{
			{"User", h.User},
			{"ProxyCommand", sshQuote(self) + " proxy --stdio %h"},
			{"IdentityFile", sshQuote(h.IdentityFile)},
			{"IdentitiesOnly", "yes"},
			{"UserKnownHostsFile", sshQuote(h.KnownHostsFile)},
			{"HostKeyAlias", h.HostKeyAlias},
			{"StrictHostKeyChecking", "yes"},
			{"BatchMode", "yes"},
			{"ForwardAgent", "no"},
		} {
			fmt.Fprintf(a.sys.Stdout, "  %s %s\n", kv[0], kv[1])
		}
	}
	return ExitOK
}

// sshQuote quotes a path for ssh_config when it needs it.
func sshQuote(s string) string {
	if !strings.ContainsAny(s, " \t\"'") {
		return s
	}
	return `"` + strings.ReplaceAll(s, `"`, `\"`) + `"`
}

// proxy is `nook proxy --stdio HOST`: the SSH stream of a sandbox on stdin
// and stdout, carried over the daemon's socket (an OpenSSH ProxyCommand).
func (a *app) proxy(ctx context.Context) int {
	if !a.p.bools["stdio"] {
		return a.fail(errdefs.Invalidf("nook proxy needs --stdio: it relays the SSH stream on stdin and stdout (ProxyCommand nook proxy --stdio %%h)"))
	}
	if len(a.p.args) != 1 {
		return a.fail(errdefs.Invalidf("name the sandbox host: nook proxy --stdio nook-NAME (see `nook ssh-config`)"))
	}
	var conn io.ReadWriteCloser
	err := a.call(ctx, func(ctx context.Context) (err error) {
		conn, err = a.c.SSHProxy(ctx, ipc.SSHProxyRequest{Host: a.p.args[0]})
		return err
	})
	if err != nil {
		return a.fail(err)
	}
	defer conn.Close()
	up := make(chan struct{})
	go func() {
		defer close(up)
		_, _ = io.Copy(conn, a.sys.Stdin)
	}()
	down := make(chan struct{})
	go func() {
		defer close(down)
		_, _ = io.Copy(a.sys.Stdout, conn)
	}()
	select {
	case <-down: // the sandbox side ended
	case <-up:
		// ssh closed our stdin: it is done with the stream.
		conn.Close()
		<-down
	}
	return ExitOK
}

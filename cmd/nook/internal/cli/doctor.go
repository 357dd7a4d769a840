package cli

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"

	"github.com/sandboxd/sandboxd/internal/gitversion"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
)

// doctorJSON is `nook doctor --json`.
type doctorJSON struct {
	OK     bool              `json:"ok"`
	Checks []ipc.DoctorCheck `json:"checks"`
}

// doctor checks each part nook depends on and says how to fix what fails:
// here the daemon, its socket, git and the file-watch limits; through the
// daemon the remote, SSH to each live sandbox and the sandboxes' clocks.
// It never starts the daemon (a doctor that changes what it examines would
// hide the problem). Exit 1 when a check fails.
func (a *app) doctor(ctx context.Context) int {
	var checks []ipc.DoctorCheck
	checks = append(checks, a.checkSocket())
	d, h, daemonUp := a.checkDaemon(ctx)
	checks = append(checks, d)
	if daemonUp {
		checks = append(checks, checkConfig(h))
	}
	checks = append(checks, checkGit(), checkWatches())
	if daemonUp {
		resp, err := a.c.Doctor(ctx)
		if err != nil {
			checks = append(checks, ipc.DoctorCheck{Name: "remote", Detail: fmt.Sprintf("sandboxd could not run its checks: %v", err), Fix: "see sandboxd's log"})
		} else {
			checks = append(checks, resp.Checks...)
		}
	} else {
		checks = append(checks, ipc.DoctorCheck{Name: "remote", Detail: "not checked: sandboxd is not running (it makes the remote and SSH checks)", Fix: "start sandboxd, then run nook doctor again"})
	}
	ok := true
	for _, c := range checks {
		ok = ok && c.OK
	}
	code := ExitOK
	if !ok {
		code = 1
	}
	if a.p.json() {
		a.printJSON(doctorJSON{OK: ok, Checks: checks})
		return code
	}
	tw := tabwriter.NewWriter(a.sys.Stdout, 0, 0, 2, ' ', 0)
	for _, c := range checks {
		mark := "ok"
		if !c.OK {
			mark = "FAIL"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", mark, c.Name, c.Detail)
		if !c.OK && c.Fix != "" {
			fmt.Fprintf(tw, "\t\tfix: %s\n", c.Fix)
		}
	}
	tw.Flush()
	return code
}

func (a *app) checkDaemon(ctx context.Context) (ipc.DoctorCheck, ipc.HealthResponse, bool) {
	c := ipc.DoctorCheck{Name: "daemon"}
	h, err := a.c.Health(ctx)
	switch {
	case errors.Is(err, client.ErrDaemonNotRunning):
		c.Detail = "sandboxd is not running"
		c.Fix = "any nook command starts it (unless SANDBOXD_NO_AUTOSTART=1); or run `sandboxd`, or `systemctl --user enable --now sandboxd.socket`"
		return c, h, false
	case err != nil:
		c.Detail = fmt.Sprintf("sandboxd does not answer properly: %v", err)
		c.Fix = "`nook daemon stop`, then any nook command starts a fresh one; see its log"
		return c, h, false
	}
	v := a.c.DaemonVersion()
	c.Detail = fmt.Sprintf("sandboxd %s running, store %s, %d sessions", v, h.Store, h.Sessions)
	c.OK = h.Status == "ok" && v == a.sys.Version
	switch {
	case v != a.sys.Version:
		c.Detail += fmt.Sprintf("; nook is %s", a.sys.Version)
		c.Fix = "restart the daemon (nook daemon stop) so that nook and sandboxd come from the same build"
	case !c.OK:
		c.Fix = "see `nook daemon status` and sandboxd's log"
	}
	return c, h, true
}

// checkConfig reports the daemon's view of its config file as it is now.
func checkConfig(h ipc.HealthResponse) ipc.DoctorCheck {
	c := ipc.DoctorCheck{Name: "config"}
	switch h.Config {
	case "":
		c.OK, c.Detail = true, "not checked (sandboxd predates the check)"
	case "ok":
		c.OK, c.Detail = true, "the config file is valid (or absent: defaults)"
	default:
		c.Detail = h.Config
		c.Fix = "fix the file (`nook config` names it), then reload sandboxd (kill -HUP its pid, or `nook daemon stop`)"
	}
	return c
}

// checkSocket checks the socket's path and permissions: a directory only
// this user can enter, a socket only this user can open.
func (a *app) checkSocket() ipc.DoctorCheck {
	sock := a.layout.Socket
	c := ipc.DoctorCheck{Name: "socket", Detail: sock}
	if len(sock) > 107 {
		c.Detail = fmt.Sprintf("%s is %d bytes, longer than a Unix socket path may be (107)", sock, len(sock))
		c.Fix = "set SANDBOXD_SOCKET or XDG_RUNTIME_DIR to a shorter path"
		return c
	}
	dir, err := os.Stat(filepath.Dir(sock))
	if errors.Is(err, fs.ErrNotExist) {
		c.OK, c.Detail = true, sock+" (not created yet: sandboxd creates it when it starts)"
		return c
	}
	if err != nil {
		c.Detail, c.Fix = err.Error(), "check the permissions of "+filepath.Dir(sock)
		return c
	}
	if st, ok := dir.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Getuid() || dir.Mode().Perm()&0o077 != 0 {
		c.Detail = fmt.Sprintf("%s is %s and must belong to you alone", filepath.Dir(sock), dir.Mode().Perm())
		c.Fix = fmt.Sprintf("stop sandboxd, then `rm -rf %s`: sandboxd recreates it with mode 0700", filepath.Dir(sock))
		return c
	}
	fi, err := os.Stat(sock)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		c.OK, c.Detail = true, sock+" (not there: sandboxd is not running)"
	case err != nil:
		c.Detail, c.Fix = err.Error(), "check the permissions of "+sock
	case fi.Mode()&fs.ModeSocket == 0:
		c.Detail, c.Fix = sock+" is not a socket", "remove it: sandboxd creates the socket when it starts"
	default:
		c.OK, c.Detail = true, fmt.Sprintf("%s (%s)", sock, fi.Mode().Perm())
	}
	return c
}

// checkGit: sync runs git on this machine.
func checkGit() ipc.DoctorCheck {
	c := ipc.DoctorCheck{Name: "git"}
	out, err := exec.Command("git", "--version").Output()
	if err != nil {
		c.Detail = fmt.Sprintf("git does not run: %v", err)
		c.Fix = "install git (apt install git, brew install git) and put it on PATH"
		return c
	}
	c.OK, c.Detail = true, strings.TrimSpace(string(out))
	// A sandbox's changes are applied with git apply: not with a version
	// that has known escapes.
	if _, err := gitversion.Check(context.Background(), "git"); errors.Is(err, gitversion.ErrUnsafe) {
		c.OK, c.Detail = false, err.Error()
		c.Fix = "upgrade git (apt install git, brew upgrade git): until then sandboxd saves the sandbox's changes under .git/sandboxd/pulls/ instead of applying them"
	}
	return c
}

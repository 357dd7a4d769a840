package sessions

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// maxClockSkew is how far a sandbox's clock may be from this machine's
// before doctor flags it (sync compares file times; expiry is computed).
const maxClockSkew = 30 * time.Second

// Doctor checks what only the daemon can: that the remote answers, and for
// each live sandbox that SSH works and how far its clock is from ours.
// Each failing check says how to fix it; checks run in parallel, each
// bounded, so that one stuck sandbox does not hold up the answer.
func (m *Manager) Doctor(ctx context.Context) (ipc.DoctorResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	var checks []ipc.DoctorCheck
	info := m.opts.Remotes.Info()
	start := m.now()
	remote, err := m.remote(ctx)
	if err == nil {
		_, err = remote.ListSandboxes(ctx)
	}
	if err != nil {
		checks = append(checks, ipc.DoctorCheck{Name: "remote", Detail: fmt.Sprintf("%s (%s) does not answer: %v", info.Name, info.Host, err),
			Fix: remoteFix(info, err)})
	} else {
		checks = append(checks, ipc.DoctorCheck{Name: "remote", OK: true, Detail: fmt.Sprintf("%s (%s) answers in %s", info.Name, info.Host, m.now().Sub(start).Round(time.Millisecond))})
	}
	all, err := m.st.List()
	if err != nil {
		return ipc.DoctorResponse{}, err
	}
	var live []*store.Session
	for _, s := range all {
		if s.State == store.StateReady {
			live = append(live, s)
		}
	}
	results := make([][]ipc.DoctorCheck, len(live))
	var wg sync.WaitGroup
	for i, s := range live {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = m.checkSandbox(ctx, s)
		}()
	}
	wg.Wait()
	for _, r := range results {
		checks = append(checks, r...)
	}
	if len(live) == 0 {
		checks = append(checks, ipc.DoctorCheck{Name: "sandboxes", OK: true, Detail: "no live sandbox to check"})
	}
	return ipc.DoctorResponse{Checks: checks}, nil
}

// checkSandbox runs `date +%s` in sandbox s over the held connection: SSH
// works, and the answer gives its clock.
func (m *Manager) checkSandbox(ctx context.Context, s *store.Session) []ipc.DoctorCheck {
	name := "ssh " + s.RunID
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := m.sandboxOf(s).link.Get(ctx, target(s))
	if err != nil {
		return []ipc.DoctorCheck{{Name: name, Detail: fmt.Sprintf("cannot connect to %s: %v", s.Address, err),
			Fix: fmt.Sprintf("`nook status --id %s` asks the remote whether the run lives; `nook reset` in %s starts a new one", s.RunID, s.RepoRoot)}}
	}
	// `date +%s` answers a dozen bytes.
	out, errb := newAnswer(64), newAnswer(1024)
	out.onOver, errb.onOver = cancel, cancel // no need to wait for the rest of a flood
	before := m.now()
	st, err := conn.Exec(ctx, "date +%s", sshpool.Stdio{Stdout: out, Stderr: errb})
	after := m.now()
	if err != nil || st.ShellCode() != 0 {
		return []ipc.DoctorCheck{{Name: name, Detail: fmt.Sprintf("a command over SSH failed: %v %s", err, printable(strings.TrimSpace(errb.String()), 512)),
			Fix: "see sandboxd's log; `nook reset` starts a new sandbox"}}
	}
	checks := []ipc.DoctorCheck{{Name: name, OK: true, Detail: fmt.Sprintf("%s (%s) answers in %s", s.RunID, s.Branch, after.Sub(before).Round(time.Millisecond))}}
	if m.opts.HelperStatus != nil {
		ok, detail := m.opts.HelperStatus(conn)
		c := ipc.DoctorCheck{Name: "helper " + s.RunID, OK: ok, Detail: detail}
		if !ok {
			c.Fix = "synced execs still work, scanning the whole tree; sandboxd's log says why the helper failed, and it is tried again later (`nook reset` starts a new sandbox)"
		}
		checks = append(checks, c)
	}
	secs, err := strconv.ParseInt(strings.TrimSpace(out.String()), 10, 64)
	if err != nil {
		return append(checks, ipc.DoctorCheck{Name: "clock " + s.RunID, Detail: fmt.Sprintf("`date +%%s` answered %q", printable(out.String(), 64)), Fix: "the sandbox has no usable date command"})
	}
	mid := before.Add(after.Sub(before) / 2)
	skew := time.Unix(secs, 0).Sub(mid).Round(time.Second)
	c := ipc.DoctorCheck{Name: "clock " + s.RunID, OK: skew.Abs() <= maxClockSkew, Detail: fmt.Sprintf("the sandbox's clock is %s from this machine's", skew)}
	if !c.OK {
		c.Fix = "sync this machine's clock (timedatectl set-ntp true, or System Settings > Date & Time on macOS)"
	}
	return append(checks, c)
}

// remoteFix says how to make the remote answer: the local remote fails
// for reasons of this machine (bubblewrap missing, namespaces refused),
// RWX Cloud for the network's or the token's.
func remoteFix(info RemoteInfo, err error) string {
	if info.Name != "local" {
		return "check the network and the access token (`nook config` says where it comes from)"
	}
	msg := err.Error()
	if strings.Contains(msg, "bwrap") || strings.Contains(msg, "bubblewrap") || strings.Contains(msg, "namespace") || strings.Contains(msg, "isolat") {
		return "the local remote cannot isolate sandboxes: install bubblewrap (apt install bubblewrap), or run them unisolated: SANDBOXD_LOCALCLOUD_ISOLATION=none in sandboxd's environment, then `sandboxd-localcloud stop` so that it restarts with it"
	}
	return "the local remote (sandboxd-localcloud) does not answer: `sandboxd-localcloud status` and sandboxd's log say why"
}

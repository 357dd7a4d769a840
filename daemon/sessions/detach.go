package sessions

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/backend"
	"github.com/sandboxd/sandboxd/store"
	"golang.org/x/crypto/ssh"
)

// Detached execs (nook exec --detach, nook attach): the command is started
// under the sandbox helper's holder and followed later, by its id.

// holderWaitTimeout bounds the wait for the sandbox helper to serve on a
// connection (installed, probed, its server ready) before a detach or an
// attach, which cannot go without it.
const holderWaitTimeout = time.Minute

// execIDPattern is an exec id as the daemon makes them (newExecID); an
// attach names one, and nothing else reaches the holder's command line.
var execIDPattern = regexp.MustCompile(`^[0-9a-f]{32}$`)

// errNoDurable: detach and attach need durable exec.
func errNoDurable(what string) error {
	return errdefs.Invalidf("%s needs durable exec: set \"durable_exec\": true in sandboxd's config (sandboxd reloads it), on a sandbox where the sandbox helper runs", what)
}

// waitHolder is the helper's file name on conn once it can hold commands:
// at most holderWaitTimeout, saying what it waits for past a second.
func (m *Manager) waitHolder(ctx context.Context, conn *sshpool.Conn, what string) (string, error) {
	m.mu.Lock()
	on := m.daemonCfg.DurableExec
	m.mu.Unlock()
	if !on || m.opts.SyncHelper == nil {
		return "", errNoDurable(what)
	}
	say := lockProgress(ctx)
	since := time.Now()
	said := false
	deadline := time.NewTimer(holderWaitTimeout)
	defer deadline.Stop()
	for {
		if name := m.holderOn(conn); name != "" {
			return name, nil
		}
		if m.opts.HelperUnavailable != nil && m.opts.HelperUnavailable(conn) {
			return "", errdefs.Unavailable(fmt.Errorf("the sandbox helper does not run on this sandbox (sync_helper off, another platform, or its start failed: see sandboxd's log); %s needs it and did not run", what))
		}
		if !said && time.Since(since) >= sayAfter {
			said = true
			say(fmt.Sprintf("%s to serve (install, probe, ready) since %s", ipc.WaitingHelper, since.Local().Format("15:04:05")))
		}
		select {
		case <-ctx.Done():
			return "", errdefs.Canceled(fmt.Errorf("waiting for the sandbox helper: %w", ctx.Err()))
		case <-conn.Done():
			return "", errdefs.Unavailable(fmt.Errorf("the connection to the sandbox ended while waiting for its helper; %s did not run: run it again", what))
		case <-deadline.C:
			return "", errdefs.Unavailable(fmt.Errorf("the sandbox helper did not serve within %s (see sandboxd's log for why); %s did not run: run it again, or without it", holderWaitTimeout, what))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// launchHeld starts command under the holder without attaching: the
// command runs on with an empty stdin. It is sent once: a launch whose
// answer was lost is not sent again (nook attach tells whether it runs).
func (m *Manager) launchHeld(ctx context.Context, lc *sshpool.Locked, helper, command string) (string, error) {
	id := newExecID()
	bin := ".git/sandboxd/bin/" + helper
	_, probeTimeout := m.waitBounds()
	var st sshpool.ExitStatus
	err := helperWait(ctx, "start the detached command", probeTimeout+helperStartSlack, func(ctx context.Context) (err error) {
		st, err = lc.Exec(ctx, fmt.Sprintf("exec %s hold launch %s -- sh -c %s", bin, id, quoteArg(command, true)), sshpool.Stdio{})
		return err
	})
	if err != nil {
		if errors.Is(err, sshpool.ErrNotSent) {
			return "", errdefs.Unavailable(fmt.Errorf("start the detached command: %w; it did not run", err))
		}
		return "", errdefs.Unavailable(fmt.Errorf("start the detached command: %w; it may or may not run: see `nook attach %s`", err, id))
	}
	if st.Code != 0 || st.Signal != "" {
		return "", errdefs.Unavailable(fmt.Errorf("the sandbox helper refused to start the detached command (exit %d); it did not run", st.Code))
	}
	return id, nil
}

// attachHeld follows the detached command req.Attach of the caller's sandbox:
// its output kept so far and on, then its exit code, read from the
// holder's state (the holder's own exit code can collide with the
// command's). It never starts anything.
func (m *Manager) attachHeld(ctx context.Context, req ipc.ExecRequest, stream backend.ExecStream) (ipc.ExecResult, error) {
	started := m.now()
	id := req.Attach
	if !execIDPattern.MatchString(id) {
		return ipc.ExecResult{}, errdefs.Invalidf("%q is not an exec id (32 hex digits, as `nook exec --detach` printed it)", id)
	}
	s, _, err := m.lookupBranch(ctx, req.Target)
	if err != nil {
		return ipc.ExecResult{}, fmt.Errorf("find the sandbox of the detached command: %w", err)
	}
	if s.RunID == "" || s.State != store.StateReady {
		return ipc.ExecResult{}, errdefs.NotFoundf("the sandbox of this checkout is not running (%s): a detached command lives in the sandbox that started it", s.State)
	}
	say := func(msg string) {
		_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecQueued, Message: msg})
		m.progress(s, ipc.PhaseWaiting, msg)
	}
	ctx = withLockProgress(ctx, say)
	conn, err := m.connect(ctx, s)
	if err != nil {
		return ipc.ExecResult{}, err
	}
	// Following a command needs no lock: the holder only reads its files.
	lc := &sshpool.Locked{Conn: conn, Relock: func(ctx context.Context) (*sshpool.Conn, error) { return m.connect(ctx, s) }}
	helper, err := m.waitHolder(ctx, conn, "nook attach")
	if err != nil {
		return ipc.ExecResult{}, err
	}
	bin := ".git/sandboxd/bin/" + helper
	hs, err := m.holdState(ctx, lc, bin, id)
	if err != nil {
		return ipc.ExecResult{}, err
	}
	if !hs.Started {
		return ipc.ExecResult{}, errdefs.NotFoundf("no command %s in sandbox %s: it was never started there (or the sandbox was replaced)", id, s.RunID)
	}
	_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecStarted})
	stdio := sshpool.Stdio{Stdout: stream.Stdout(), Stderr: stream.Stderr(), Signals: forwardSignals(ctx, stream)}
	if _, err := m.execProbing(ctx, lc, fmt.Sprintf("exec %s hold attach %s 0 0", bin, id), stdio, "the attach ends; `nook attach` again reattaches"); err != nil {
		if ctx.Err() != nil {
			return ipc.ExecResult{}, errdefs.Canceled(fmt.Errorf("the attach was cancelled because the client went away: %w", err))
		}
		return ipc.ExecResult{}, errdefs.Unavailable(fmt.Errorf("following command %s: %w; it may still run: `nook attach %s` again", id, err, id))
	}
	if hs, err = m.holdState(ctx, lc, bin, id); err != nil {
		return ipc.ExecResult{}, err
	}
	if !hs.Ended || hs.ExitCode == nil || *hs.ExitCode < 0 || *hs.ExitCode > 255 {
		return ipc.ExecResult{}, errdefs.Unavailable(fmt.Errorf("the attach to command %s ended but the sandbox reports no exit status for it; it may still run: `nook attach %s` again", id, id))
	}
	res := ipc.ExecResult{RunID: s.RunID, RunURL: s.RunURL, PulledFiles: []string{}, ExitCode: *hs.ExitCode, ExecID: id}
	if hs.Signal != "" && signalName.MatchString(hs.Signal) {
		res.Signal = hs.Signal
	}
	res.DurationMs = m.now().Sub(started).Milliseconds()
	return res, nil
}

var signalName = regexp.MustCompile(`^[A-Z0-9]{1,10}$`)

// forwardSignals relays the caller's signal frames to a command until ctx
// ends.
func forwardSignals(ctx context.Context, stream backend.ExecStream) <-chan ssh.Signal {
	out := make(chan ssh.Signal, 4)
	go func() {
		in := stream.Signals()
		for {
			select {
			case <-ctx.Done():
				return
			case sig, ok := <-in:
				if !ok {
					return
				}
				select {
				case out <- ssh.Signal(sig):
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	return out
}

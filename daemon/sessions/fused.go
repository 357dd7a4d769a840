package sessions

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/sandboxd/sandboxd/daemon/gitsync"
	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/backend"
	"github.com/sandboxd/sandboxd/store"
)

// fusedAttempts bounds the exchanges that found something to do before the
// command (edits of an earlier exec, a commit to push); after them the exec
// takes the separate steps, which handle every case.
const fusedAttempts = 2

// pullTimeout bounds bringing a command's edits back once it ran: the
// pull outlives its caller (nothing made in the sandbox is lost), but not
// for longer than this, whatever the sandbox answers.
const pullTimeout = 20 * time.Minute

// execFused runs a synced exec as one exchange with the sandbox: push,
// command and pull in one remote command (gitsync.Exchange). done false,
// with no error, means the command has not run and the caller takes the
// separate steps (a patch too large to travel inside a command, or an
// exchange that kept finding work to do first). dir is where the command
// runs (execDir).
func (m *Manager) execFused(ctx context.Context, lc *sshpool.Locked, s *store.Session, req ipc.ExecRequest, dir string, stream backend.ExecStream, res *ipc.ExecResult, warn func(string)) (done bool, err error) {
	runner := m.runner(lc)
	if helper := m.holderOn(lc.Conn); helper != "" {
		runner = gitsync.WithRelay(runner, m.relayExchanges(m.sandboxOf(s), lc, helper))
	}
	for attempt := 0; attempt < fusedAttempts; attempt++ {
		patch, err := m.prepare(ctx, runner, s, attempt == 0, true, warn)
		if err != nil {
			return true, err
		}
		ex, ok, err := m.opts.Sync.Fuse(ctx, runner, patch, remoteCommand(dir, req.Env, req.Argv))
		if err != nil {
			return true, m.syncFailed(s, err)
		}
		if !ok {
			return false, nil
		}
		m.mu.Lock()
		durable := m.daemonCfg.DurableExec
		m.mu.Unlock()
		if !durable {
			if err := ex.Unheld(); err != nil {
				return true, err
			}
		}
		if attempt == 0 {
			m.publish(eventExecStarted, s, map[string]any{"argv0": req.Argv[0]})
			_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecStarted})
		}
		runErr := m.exchange(ctx, s, lc, runner, ex, req, stream)
		if runErr != nil && (ctx.Err() != nil || !ex.Started()) {
			if ctx.Err() != nil {
				// The caller went away: what the command changed is saved,
				// not applied to a tree nobody is watching.
				m.saveAbandoned(ctx, lc, s)
				return true, errdefs.Canceled(fmt.Errorf("the command was cancelled because the client went away: %w", runErr))
			}
			if errors.Is(runErr, sshpool.ErrConnectionLost) {
				// Never re-sent: the command may have run.
				return true, errdefs.Unavailable(fmt.Errorf("the connection to the sandbox broke during the exchange; the command may or may not have started, so it was not run again (check its effects before you run it again): %w", runErr))
			}
			if errors.Is(runErr, gitsync.ErrForgedReport) {
				return true, runErr
			}
			if !errors.Is(runErr, sshpool.ErrNotSent) {
				return true, errdefs.Unavailable(fmt.Errorf("run the command in the sandbox: %w", runErr))
			}
			return true, runErr
		}
		if m.opts.Pause != nil {
			m.opts.Pause("exec-after-command")
		}
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), pullTimeout)
		fr, err := ex.Finish(fctx, runner)
		cancel()
		for _, w := range fr.Push.Warnings {
			warn(w)
		}
		if fr.Push.Recovered != nil {
			res.PulledFiles = append(res.PulledFiles, fr.Push.Recovered.Files...)
		}
		if err != nil {
			if errors.Is(err, gitsync.ErrForgedReport) || ex.Started() {
				// Not the push's failure: the command started.
				return true, err
			}
			return true, m.syncFailed(s, err)
		}
		if fr.Split {
			return false, nil
		}
		if fr.Again {
			continue
		}
		res.ExitCode, res.Signal = fr.ExitCode, fr.Signal
		res.PulledFiles = append(res.PulledFiles, fr.Pull.Files...)
		if fr.PullErr != nil {
			warn(fmt.Sprintf("pulling the sandbox's changes failed: %v", fr.PullErr))
		}
		for _, w := range fr.Pull.Warnings {
			warn(w)
		}
		return true, nil
	}
	return false, nil
}

// exchange runs ex on runner with the caller's streams and signals,
// probing the connection as a held exec does. When the connection is lost
// while the held command runs, it reattaches on a new connection
// (reattachExchange); when that fails, the exchange ends with the command's
// end unknown, never run again.
func (m *Manager) exchange(ctx context.Context, s *store.Session, lc *sshpool.Locked, runner gitsync.Runner, ex *gitsync.Exchange, req ipc.ExecRequest, stream backend.ExecStream) error {
	done := make(chan struct{})
	defer close(done)
	signals := relaySignals[string](stream.Signals(), done)
	out, errw := &counted{w: stream.Stdout()}, &counted{w: stream.Stderr()}
	cio := gitsync.ExchangeIO{Stdout: out, Stderr: errw, Signals: signals}
	if req.Stdin {
		cio.Stdin = stream.Stdin()
	}
	pctx := withLockProgress(ctx, func(msg string) {
		_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecQueued, Message: msg})
		m.progress(s, ipc.PhaseWaiting, msg)
	})
	began := time.Now().UnixNano()
	stop := m.probeConn(pctx, lc.Conn, afterHeld)
	err := ex.Run(ctx, runner, cio)
	stop()
	if err == nil && ctx.Err() == nil && ex.Held() && !ex.Exited() {
		// The helper ended (killed) while the held command ran, its
		// connection fine: the command goes on; attach to it by id on the
		// same connection, once.
		m.log.Info("the sandbox helper ended while a synced held command ran; reattaching", "run", s.RunID)
		_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecWarning, Message: "the sandbox helper ended while the command ran; the command went on in the sandbox and is reattached"})
		stop := m.probeConn(pctx, lc.Conn, afterHeld)
		err = ex.Reattach(ctx, runner, cio)
		stop()
	}
	if err == nil || ctx.Err() != nil || !ex.Held() || ex.Exited() || !errors.Is(err, sshpool.ErrConnectionLost) {
		return err
	}
	// Silence gives no time of its own: the last byte received is the
	// best bound of when the connection went.
	lost := func() time.Time { return time.Unix(0, max(began, out.last.Load(), errw.last.Load())) }
	if err = m.reattachExchange(pctx, s, lc, ex, cio, stream, err, lost); err != nil && !ex.Exited() {
		ex.GiveUp(errdefs.Unavailable(fmt.Errorf("the connection to the sandbox broke while the command ran and reattaching to it failed: the command may still be running in the sandbox and was not run again; what it changed stays there and the next exec brings it back: %w", err)))
	}
	return err
}

// reattachExchange follows the held command of ex after its connection
// was lost (err): it takes the lock on a new connection and asks a new
// exchange helper for the rest (gitsync.Exchange.Reattach), all attempts
// together bounded by reattach_timeout, saying on stderr that the
// connection dropped. It asks for the command's id only: nothing here can
// start the command again.
func (m *Manager) reattachExchange(ctx context.Context, s *store.Session, lc *sshpool.Locked, ex *gitsync.Exchange, cio gitsync.ExchangeIO, stream backend.ExecStream, err error, lost func() time.Time) error {
	bound := m.reattachTimeout()
	by := time.Now().Add(bound)
	for attempt := 0; attempt < reattachAttempts && err != nil && errors.Is(err, sshpool.ErrConnectionLost) && ctx.Err() == nil && !ex.Exited(); attempt++ {
		at := lost()
		m.log.Info("the connection broke while a synced held command ran; reattaching", "run", s.RunID, "err", err)
		conn, lerr := m.relockBy(ctx, s, by, bound)
		if lerr != nil {
			return fmt.Errorf("%w; reattaching failed: %w", err, lerr)
		}
		lc.Conn = conn
		msg := fmt.Sprintf("the connection to the sandbox dropped for about %s (nothing came since); the command went on in the sandbox and is reattached", time.Since(at).Round(100*time.Millisecond))
		_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecWarning, Message: msg})
		stop := m.probeConn(ctx, conn, afterHeld)
		err = ex.Reattach(ctx, m.runner(lc), cio)
		stop()
	}
	if ex.Exited() {
		// The status came: a pull cut short is fetched again (Finish).
		return nil
	}
	return err
}

// prepare makes the sync patch of s's working tree, telling the caller its
// warnings when tell; fused: for an exchange (Fuse) on r.
func (m *Manager) prepare(ctx context.Context, r gitsync.Runner, s *store.Session, tell, fused bool, warn func(string)) (*gitsync.Patch, error) {
	base := s.BaseSHA
	if base == "" {
		// A run sandboxd did not create: learn where it started.
		var err error
		if base, err = m.learnBase(ctx, r, s); err != nil {
			return nil, err
		}
	}
	prepare := m.opts.Sync.Prepare
	if fused {
		prepare = func(ctx context.Context, root, base string) (*gitsync.Patch, error) {
			return m.opts.Sync.PrepareExchange(ctx, r, root, base)
		}
	}
	patch, err := prepare(ctx, s.RepoRoot, base)
	if err != nil {
		return nil, fmt.Errorf("prepare the sync patch: %w", err)
	}
	patch.Sandbox = s.RunID
	if tell {
		for _, w := range patch.Warnings {
			warn(w)
		}
	}
	return patch, nil
}

// syncFailed explains a failed push. A sandbox that cannot sync is useless:
// it is ended so that the next exec gets a fresh one.
func (m *Manager) syncFailed(s *store.Session, err error) error {
	if errors.Is(err, gitsync.ErrNoGitDir) {
		m.stopQuietly(s, "the sandbox has no git checkout")
		return errdefs.Gone(fmt.Errorf("sandbox %s has no .git directory, so your changes cannot be synced; it was stopped: run the command again to get a fresh sandbox", s.RunID))
	}
	return fmt.Errorf("sync your changes to the sandbox: %w", err)
}

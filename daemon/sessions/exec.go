package sessions

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/sandboxd/sandboxd/daemon/gitsync"
	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/backend"
	"github.com/sandboxd/sandboxd/store"
	"golang.org/x/crypto/ssh"
)

// Agent directives (exec requests the sandbox agent interprets itself).
const (
	directiveLock   = "__rwx_sandbox_lock_requested__"
	directiveUnlock = "__rwx_sandbox_lock_released__"
	directiveEnd    = "__rwx_sandbox_end__"
	// Sync markers: the run's log on RWX Cloud hides what is sent between
	// them. Sent without waiting (sshpool.Conn.Send): they cost no round
	// trip.
	directiveSyncStart = "__rwx_sandbox_sync_start__"
	directiveSyncEnd   = "__rwx_sandbox_sync_end__"
)

// unlockTimeout bounds releasing the agent lock after the caller went away.
const unlockTimeout = 10 * time.Second

// Exec runs req.Argv in the caller's sandbox: resolve (or adopt, or create)
// the session, wait for its turn in the sandbox's FIFO, hold the agent lock,
// push the working tree, run the command with the caller's streams, pull the
// sandbox's edits back, release the lock.
func (m *Manager) Exec(ctx context.Context, req ipc.ExecRequest, stream backend.ExecStream) (_ ipc.ExecResult, err error) {
	started := m.now()
	if req.Attach != "" {
		return m.attachHeld(ctx, req, stream)
	}
	if req.Detach && req.TTY != nil {
		return ipc.ExecResult{}, errdefs.Invalidf("a detached command has no terminal: leave out -t")
	}
	if len(req.Argv) == 0 {
		return ipc.ExecResult{}, errdefs.Invalidf("no command given: pass it after --, for example `nook exec -- make test`")
	}
	if req.Reset {
		// The config changed: a new sandbox first, in the same call.
		_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecQueued, Message: "replacing the sandbox: stopping it and starting a new run"})
		if _, err := m.Reset(ctx, ipc.StartRequest{Target: req.Target}); err != nil {
			return ipc.ExecResult{}, fmt.Errorf("replace the sandbox: %w", err)
		}
	}
	s, p, err := m.sessionForExec(ctx, req.Target, func(msg string) {
		_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecQueued, Message: msg})
	}, func(msg string) {
		_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecWarning, Message: msg})
	})
	if err != nil {
		return ipc.ExecResult{}, err
	}
	// A running command (or shell) keeps the sandbox from the idle stop.
	defer m.hold(s.ID)()
	if req.Target.RunID != "" && !req.NoSync {
		if p, err = m.idCheckout(req.Target, s); err != nil {
			return ipc.ExecResult{}, err
		}
	}
	m.publish(eventExecQueued, s, map[string]any{"argv0": req.Argv[0]})
	defer func() {
		if err != nil {
			// Editors following events see every queued exec end.
			m.publish(eventExecFinished, s, map[string]any{"error": err.Error(), "durationMs": m.now().Sub(started).Milliseconds()})
		}
	}()
	queueTimeout := m.queueTimeout()
	qctx, qcancel := context.WithTimeout(ctx, queueTimeout)
	ahead := 0
	release, err := m.sandboxOf(s).line.Acquire(qctx, func(position int) {
		ahead = position
		_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecQueued, Position: position})
	})
	qcancel()
	if err != nil {
		if ctx.Err() == nil {
			return ipc.ExecResult{}, errdefs.Unavailable(fmt.Errorf("waited %s for the sandbox (%d ahead in its queue); the command did not run: retry once the commands ahead are over, or run `nook reset` to start a new sandbox (queue_timeout in sandboxd's config sets this bound)", queueTimeout, ahead))
		}
		return ipc.ExecResult{}, errdefs.Canceled(fmt.Errorf("waiting for the sandbox: %w", err))
	}
	defer release()
	// The session may have been stopped while this exec waited its turn.
	if s, err = m.st.Get(s.ID); err != nil {
		return ipc.ExecResult{}, err
	}
	if s.State.Terminal() {
		return ipc.ExecResult{}, endedError(s)
	}
	s = bindCheckout(s, p)
	// The lock is leased: held across a burst of execs, released after a
	// short idle time, never on this caller's path. A wait for it says
	// what it waits for.
	conn, leaseDone, err := m.lockSandbox(withLockProgress(ctx, func(msg string) {
		_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecQueued, Message: msg})
		m.progress(s, ipc.PhaseWaiting, msg)
	}), s)
	if err != nil {
		return ipc.ExecResult{}, err
	}
	defer leaseDone()
	lc := &sshpool.Locked{Conn: conn, Relock: func(ctx context.Context) (*sshpool.Conn, error) { return m.relock(ctx, s) }}

	res := ipc.ExecResult{RunID: s.RunID, RunURL: m.browserURL(s.RunURL), PulledFiles: []string{}}
	warn := func(msg string) {
		res.Warnings = append(res.Warnings, msg)
		_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecWarning, Message: msg})
	}
	if msg := m.driftWarning(s); msg != "" {
		warn(msg)
	}
	runner := m.runner(lc)
	sync := !req.NoSync && p.RepoRoot != "" && p.RepoRoot == s.RepoRoot
	holder := ""
	if req.Detach {
		if holder, err = m.waitHolder(withLockProgress(ctx, func(msg string) {
			_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecQueued, Message: msg})
			m.progress(s, ipc.PhaseWaiting, msg)
		}), lc.Conn, "nook exec --detach"); err != nil {
			return ipc.ExecResult{}, err
		}
	}
	dir := execDir(req, p, s)
	locked := m.now()
	if sync && req.TTY == nil && !req.Detach {
		// The common case: push, command and pull in one exchange.
		done, err := m.execFused(ctx, lc, s, req, dir, stream, &res, warn)
		if err != nil {
			return ipc.ExecResult{}, err
		}
		if done {
			res.DurationMs = m.now().Sub(started).Milliseconds()
			m.log.Debug("exec", "run", s.RunID, "exit", res.ExitCode, "sync", "fused", "wait_and_lock", locked.Sub(started), "exchange", m.now().Sub(locked))
			m.recordExec(s, res)
			return res, nil
		}
	}
	if sync {
		m.mark(ctx, lc, directiveSyncStart)
		// A detached command has no pull after it: its push records no
		// pending edits.
		out, err := m.push(ctx, runner, s, req.Detach, warn)
		m.mark(ctx, lc, directiveSyncEnd)
		res.PulledFiles = append(res.PulledFiles, out.recovered...)
		if err != nil {
			return ipc.ExecResult{}, err
		}
	}

	if req.Detach {
		// The command runs on without a caller: nothing of it is pulled
		// back (its edits stay in the sandbox).
		id, err := m.launchHeld(ctx, lc, holder, remoteCommand(dir, req.Env, req.Argv))
		if err != nil {
			return ipc.ExecResult{}, err
		}
		m.publish(eventExecStarted, s, map[string]any{"argv0": req.Argv[0], "execId": id})
		_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecStarted})
		res.ExecID = id
		res.DurationMs = m.now().Sub(started).Milliseconds()
		return res, nil
	}
	m.publish(eventExecStarted, s, map[string]any{"argv0": req.Argv[0]})
	_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecStarted})
	pushed := m.now()
	status, runErr := m.run(ctx, s, lc, req, stream, remoteCommand(dir, req.Env, req.Argv), stream.Stdout())
	if runErr != nil {
		if sync && ctx.Err() != nil {
			// The caller went away and the command was stopped: what it
			// changed is saved, not applied to a tree nobody is watching.
			m.saveAbandoned(ctx, lc, s)
		}
		return ipc.ExecResult{}, runErr
	}
	res.ExitCode, res.Signal = status.ShellCode(), status.Signal
	ran := m.now()

	if sync {
		if m.opts.Pause != nil {
			m.opts.Pause("exec-after-command")
		}
		m.mark(ctx, lc, directiveSyncStart)
		pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), pullTimeout)
		pull, err := m.opts.Sync.Pull(pctx, runner, s.RepoRoot)
		cancel()
		m.mark(ctx, lc, directiveSyncEnd)
		if err != nil {
			warn(fmt.Sprintf("pulling the sandbox's changes failed: %v", err))
		}
		res.PulledFiles = append(res.PulledFiles, pull.Files...)
		for _, w := range pull.Warnings {
			warn(w)
		}
	}
	done := m.now()
	res.DurationMs = done.Sub(started).Milliseconds()
	m.log.Debug("exec", "run", s.RunID, "exit", res.ExitCode, "sync", sync,
		"wait_and_lock", locked.Sub(started), "push", pushed.Sub(locked), "command", ran.Sub(pushed), "pull", done.Sub(ran))
	m.recordExec(s, res)
	return res, nil
}

// sessionForExec finds the caller's session, adopting or creating it, and
// waits until it is ready, telling the caller when it has to wait (progress)
// and when the remote fails meanwhile (warn).
func (m *Manager) sessionForExec(ctx context.Context, t ipc.Target, progress, warn func(string)) (*store.Session, place, error) {
	s, p, err := m.lookupBranch(ctx, t)
	switch {
	case err == nil && s.RunID != "":
	case err == nil || errors.Is(err, errdefs.ErrNotFound) && p.RepoRoot != "":
		progress(fmt.Sprintf("starting a sandbox for %s (branch %s)", p.RepoRoot, p.Branch))
		if s, err = m.create(ctx, p, nil); err != nil {
			return nil, p, err
		}
	default:
		return nil, p, err
	}
	if s.State != store.StateReady {
		progress(fmt.Sprintf("waiting for sandbox %s to be ready%s", s.RunID, parenthesized(m.browserURL(s.RunURL))))
	}
	s, err = m.waitReadyReporting(ctx, s, 0, warn)
	return s, p, err
}

// connect returns the held connection of session s. When the agent cannot
// be reached it asks the remote why: a run that is over ends the session, an
// agent that moved (the local remote restarted) is followed, anything else
// is reported as unavailable and the session kept.
func (m *Manager) connect(ctx context.Context, s *store.Session) (*sshpool.Conn, error) {
	conn, err := m.sandboxOf(s).link.Get(ctx, target(s))
	if err == nil {
		return conn, nil
	}
	remote, rerr := m.remote(ctx)
	if rerr != nil {
		return nil, errdefs.Unavailable(fmt.Errorf("%w (and the remote cannot be asked about it: %v)", err, rerr))
	}
	ci, cerr := m.connectionInfo(ctx, remote, s)
	switch {
	case definitelyOver(cerr):
		return nil, endedError(m.expire(s, remoteReason(cerr)))
	case cerr != nil:
	case ci.Polling.Completed && !ci.Sandboxable: // RWX marks a ready sandbox completed too
		return nil, endedError(m.expire(s, "the run is over"))
	case moved(s, ci):
		moved, merr := m.markReady(s, ci)
		if merr != nil {
			return nil, merr
		}
		if conn, err = m.sandboxOf(moved).link.Get(ctx, target(moved)); err == nil {
			return conn, nil
		}
	}
	return nil, errdefs.Unavailable(err)
}

// directive runs an agent directive, which must succeed silently.
func (m *Manager) directive(ctx context.Context, conn *sshpool.Conn, name string) error {
	// On this connection only: the lock belongs to the connection that
	// took it.
	st, err := conn.ExecOnce(ctx, name, sshpool.Stdio{})
	if err != nil {
		return errdefs.Unavailable(err)
	}
	if st.Code != 0 || st.Signal != "" {
		return errdefs.Unavailable(fmt.Errorf("agent refused %s (exit %d)", name, st.Code))
	}
	return nil
}

// abandonTimeout bounds saving the edits of an exec whose caller went away.
const abandonTimeout = 30 * time.Second

// saveAbandoned keeps the edits of a command whose caller went away in a
// patch file under the repository's .git/sandboxd/pulls/ (said in the
// daemon's log), so the next exec starts from the local tree and nothing
// is lost. If it fails, the sandbox keeps them and the next exec brings
// them back.
func (m *Manager) saveAbandoned(ctx context.Context, lc *sshpool.Locked, s *store.Session) {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), abandonTimeout)
	defer cancel()
	m.mark(sctx, lc, directiveSyncStart)
	res, err := m.opts.Sync.Save(sctx, m.runner(lc), s.RepoRoot)
	m.mark(sctx, lc, directiveSyncEnd)
	switch {
	case err != nil:
		m.log.Warn("save the edits of an exec whose caller went away; the next exec brings them back", "run", s.RunID, "err", err)
	case res.SavedPatch != "":
		m.log.Warn("the caller went away; the sandbox's edits were saved, not applied", "run", s.RunID, "patch", res.SavedPatch, "files", res.Files)
	}
}

// mark sends a sync marker without waiting; a marker that could not be
// sent only costs the run's log its filtering.
func (m *Manager) mark(ctx context.Context, lc *sshpool.Locked, marker string) {
	if err := lc.Conn.Send(ctx, marker); err != nil {
		m.log.Debug("sync marker not sent", "marker", marker, "err", err)
	}
}

// pushOutcome is what a push did.
type pushOutcome struct {
	result gitsync.PushResult
	// files the working-tree patch changed.
	files []string
	// recovered are the files of an earlier exec's edits brought back.
	recovered []string
}

// push syncs the working tree into the sandbox. Edits of an earlier exec
// that the sandbox still held (the daemon died before pulling them) come
// back first. pushOnly records no pending edits (no pull follows).
func (m *Manager) push(ctx context.Context, r gitsync.Runner, s *store.Session, pushOnly bool, warn func(string)) (pushOutcome, error) {
	var out pushOutcome
	for attempt := 0; ; attempt++ {
		patch, err := m.prepare(ctx, r, s, attempt == 0, false, warn)
		if err != nil {
			return out, err
		}
		patch.PushOnly = pushOnly
		res, err := m.opts.Sync.Push(ctx, r, patch)
		for _, w := range res.Warnings {
			warn(w)
		}
		if res.Recovered != nil {
			out.recovered = append(out.recovered, res.Recovered.Files...)
		}
		out.result, out.files = res, patch.Files
		if err != nil {
			return out, m.syncFailed(s, err)
		}
		if !res.Again {
			return out, nil
		}
		if attempt > 0 {
			return out, errdefs.Unavailable(errors.New("sync your changes to the sandbox: it kept reporting edits of earlier execs: run `nook reset` if this persists"))
		}
	}
}

// relaySignals passes the caller's signals on, as T, until done closes.
func relaySignals[T ~string](in <-chan string, done <-chan struct{}) <-chan T {
	out := make(chan T, 4)
	go func() {
		for {
			select {
			case <-done:
				return
			case sig, ok := <-in:
				if !ok {
					return
				}
				select {
				case out <- T(sig):
				case <-done:
					return
				}
			}
		}
	}()
	return out
}

// run runs the user's command with the caller's streams and signals.
// command is the remote command line, stdout where its output goes. With
// s, the command is held by the sandbox helper where it can be (no
// terminal): it then survives a lost connection.
func (m *Manager) run(ctx context.Context, s *store.Session, conn *sshpool.Locked, req ipc.ExecRequest, stream backend.ExecStream, command string, stdout io.Writer) (sshpool.ExitStatus, error) {
	done := make(chan struct{})
	defer close(done)
	signals := relaySignals[ssh.Signal](stream.Signals(), done)
	var stdin io.Reader
	if req.Stdin {
		stdin = stream.Stdin()
	}
	stdio := sshpool.Stdio{Stdin: stdin, Stdout: stdout, Stderr: stream.Stderr(), Signals: signals}
	if req.TTY != nil {
		stdio.PTY = &sshpool.PTY{Term: req.TTY.Term, Cols: uint32(req.TTY.Cols), Rows: uint32(req.TTY.Rows)}
		stdio.Resizes = resizes(stream, done)
	}
	var st sshpool.ExitStatus
	var err error
	if helper := m.holderOn(conn.Conn); s != nil && helper != "" && req.TTY == nil {
		st, err = m.runHeld(ctx, s, conn, helper, stdio, command, stream)
	} else {
		// A connection that goes silent under the command is found by
		// probes, saying what they wait for, not by the keepalives.
		pctx := withLockProgress(ctx, func(msg string) {
			_ = stream.Send(ipc.ExecOutput{Type: ipc.ExecQueued, Message: msg})
			if s != nil {
				m.progress(s, ipc.PhaseWaiting, msg)
			}
		})
		st, err = m.execProbing(pctx, conn, command, stdio, afterPlain)
	}
	if err != nil {
		if ctx.Err() != nil {
			return st, errdefs.Canceled(fmt.Errorf("the command was cancelled because the client went away: %w", err))
		}
		if errors.Is(err, sshpool.ErrConnectionLost) {
			// Never re-sent: the command may have run.
			return st, errdefs.Unavailable(fmt.Errorf("the connection to the sandbox broke while the command ran; it may or may not have completed, so it was not run again (check its effects before you run it again): %w", err))
		}
		return st, errdefs.Unavailable(fmt.Errorf("run the command in the sandbox: %w", err))
	}
	return st, nil
}

// resizes relays the caller's window sizes, when its stream carries them,
// until done.
func resizes(stream backend.ExecStream, done <-chan struct{}) <-chan sshpool.WindowSize {
	rs, ok := stream.(backend.ExecResizer)
	if !ok {
		return nil
	}
	out := make(chan sshpool.WindowSize, 1)
	go func() {
		in := rs.Resizes()
		for {
			select {
			case <-done:
				return
			case ws, ok := <-in:
				if !ok {
					return
				}
				select {
				case out <- sshpool.WindowSize{Cols: uint32(ws.Cols), Rows: uint32(ws.Rows)}:
				case <-done:
					return
				}
			}
		}
	}()
	return out
}

// recordExec updates the exec statistics off the hot path: the caller has
// its answer before the store write is synced. The records of a burst are
// written together (one transaction, one sync, per session and flush
// rather than per exec). Readers that show the statistics call
// flushExecRecords first, so they never see them stale.
func (m *Manager) recordExec(s *store.Session, res ipc.ExecResult) {
	now := m.now()
	m.publish(eventExecFinished, s, map[string]any{"exitCode": res.ExitCode, "durationMs": res.DurationMs})
	c := m.sandboxOf(s)
	m.records.Lock()
	defer m.records.Unlock()
	t := c.tally
	// Concurrent execs take their times before the lock, so a later one
	// may get here first: the latest time stays.
	if now.After(t.last) {
		t.last = now
	}
	t.count++
	c.tally = t
	if !c.pending {
		c.pending = true
		m.pending = append(m.pending, c)
	}
	if !m.flushing {
		m.flushing = true
		m.wg.Add(1)
		go m.flushRecords()
	}
}

// execTally is what recordExec has not yet written for one session.
type execTally struct {
	last  time.Time
	count int64
}

// recordDelay is how long the records of a burst are gathered before they
// are written (flushExecRecords does not wait for it).
const recordDelay = 50 * time.Millisecond

// flushRecords writes the gathered records until none are left.
func (m *Manager) flushRecords() {
	defer m.wg.Done()
	for {
		t := time.NewTimer(recordDelay)
		select {
		case <-t.C:
		case <-m.flushNow:
			t.Stop()
		}
		m.records.Lock()
		batch := make(map[string]execTally, len(m.pending))
		for _, c := range m.pending {
			// An ended controller and its successor may share the id.
			t := batch[c.id]
			if c.tally.last.After(t.last) {
				t.last = c.tally.last
			}
			t.count += c.tally.count
			batch[c.id] = t
			c.tally, c.pending = execTally{}, false
		}
		m.pending = nil
		m.writing = len(batch)
		m.records.Unlock()
		for id, t := range batch {
			if _, err := m.st.Update(id, func(s *store.Session) error {
				if t.last.After(s.LastExecAt) {
					s.LastExecAt = t.last
				}
				s.ExecCount += t.count
				return nil
			}); err != nil {
				m.log.Warn("record exec", "session", id, "err", err)
			}
		}
		m.records.Lock()
		m.writing = 0
		m.recordsDone.Broadcast()
		if len(m.pending) == 0 {
			m.flushing = false
			m.records.Unlock()
			return
		}
		m.records.Unlock()
	}
}

// flushExecRecords waits until the exec statistics recorded so far are in
// the store, having them written at once.
func (m *Manager) flushExecRecords() {
	m.records.Lock()
	defer m.records.Unlock()
	for len(m.pending) > 0 || m.writing > 0 {
		select {
		case m.flushNow <- struct{}{}:
		default:
		}
		m.recordsDone.Wait()
	}
}

// runner is the sync's way to the sandbox for one exec: lc, and the
// helper serving on its connection, asked here once (sessions → helper),
// so that gitsync calls down into sshpool and never back into sessions.
func (m *Manager) runner(lc *sshpool.Locked) gitsync.Runner {
	if m.opts.SyncHelper == nil {
		return lc
	}
	name, inst := m.opts.SyncHelper(lc.Conn)
	return gitsync.WithHelper(lc, name, inst)
}

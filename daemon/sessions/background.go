package sessions

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/sandboxd/sandboxd/daemon/events"
	"github.com/sandboxd/sandboxd/daemon/forward"
	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/internal/helperproto"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// Managed-process directives of the sandbox agent (RWX CLI `sandbox
// background`): the directive, a space, a JSON request; one JSON process
// record on stdout; exit 127 when the agent does not support them.
const (
	directiveProcessStart   = "__rwx_sandbox_process_start__"
	directiveProcessRestart = "__rwx_sandbox_process_restart__"
	directiveProcessStop    = "__rwx_sandbox_process_stop__"
	directiveProcessStatus  = "__rwx_sandbox_process_status__"
	directiveProcessLogs    = "__rwx_sandbox_process_logs__"
)

// Forwards owns the daemon's local port forwards (*forward.Manager).
type Forwards interface {
	NewSet() ForwardSet
}

// ForwardSet is the forwards of one sandbox, owned by its controller
// (*forward.Set satisfies it).
type ForwardSet interface {
	Open(spec forward.Spec) (forward.Info, error)
	Close(name string) bool
	CloseAll() []forward.Info
	Get(name string) (forward.Info, bool)
}

// ForwardSets is the Forwards of a *forward.Manager.
func ForwardSets(m *forward.Manager) Forwards { return forwardSets{m} }

type forwardSets struct{ m *forward.Manager }

func (f forwardSets) NewSet() ForwardSet { return f.m.NewSet() }

// portReadyTimeout bounds waiting for a started process to listen on its
// forwarded port (as the RWX CLI does).
const portReadyTimeout = 30 * time.Second

// processRecord is the agent's answer (the RWX CLI's field names).
type processRecord struct {
	Key         string `json:"key"`
	Status      string `json:"status"`
	TargetPort  int    `json:"targetPort"`
	PID         int    `json:"pid"`
	PGID        int    `json:"pgid"`
	Command     string `json:"command"`
	StartedAt   string `json:"startedAt"`
	CompletedAt string `json:"completedAt"`
	ExitCode    *int   `json:"exitCode"`
	Signal      string `json:"signal"`
	StdoutPath  string `json:"stdoutPath"`
	StderrPath  string `json:"stderrPath"`
}

// bgSession finds the caller's sandbox, which must exist already (as with
// the RWX CLI: a background process is not worth creating a sandbox for
// implicitly), and waits until it is ready.
func (m *Manager) bgSession(ctx context.Context, t ipc.Target) (*store.Session, place, error) {
	s, p, err := m.lookupBranch(ctx, t)
	if err != nil {
		return nil, p, err
	}
	if s.RunID == "" {
		return nil, p, errdefs.Conflictf("the sandbox of %s is still being created: wait for it (`nook start --wait`), then retry", s.RepoRoot)
	}
	s, err = m.waitReady(ctx, s, 0)
	if err == nil {
		m.touch(s.ID)
	}
	return s, p, err
}

// BgStart syncs the working tree (as an exec does), starts or replaces the
// named process, and with a port forwards a local port to it, then waits
// (up to 30s) until the port answers in the sandbox.
func (m *Manager) BgStart(ctx context.Context, req ipc.BgStartRequest) (ipc.BgProcess, error) {
	if req.Port != 0 && m.opts.Forwards == nil {
		return ipc.BgProcess{}, errdefs.Unavailable(errors.New("port forwarding is not available in this daemon"))
	}
	if req.Name == helperproto.ProcessKey {
		return ipc.BgProcess{}, errdefs.Invalidf("%q is the name of sandboxd's sandbox helper: choose another name", req.Name)
	}
	s, p, err := m.bgSession(ctx, req.Target)
	if err != nil {
		return ipc.BgProcess{}, err
	}
	if s, p, err = m.bgCheckout(req.Target, s, p, !req.NoSync); err != nil {
		return ipc.BgProcess{}, err
	}
	command := shellQuote(req.Argv)
	if len(req.Argv) == 0 {
		if command, req.Port, err = predefinedCommand(s, req); err != nil {
			return ipc.BgProcess{}, err
		}
		if req.Port != 0 && m.opts.Forwards == nil {
			return ipc.BgProcess{}, errdefs.Unavailable(errors.New("port forwarding is not available in this daemon"))
		}
	}
	prev := findBackground(s, req.Name)
	var opened bool
	rec, err := m.bgLocked(ctx, s, p, !req.NoSync, func(conn execer) (processRecord, error) {
		if req.Port != 0 {
			// The local port is taken before the process starts, so that a
			// port in use changes nothing in the sandbox.
			if opened, err = m.openForward(s, req.Name, req.Port, req.LocalPort, prev); err != nil {
				return processRecord{}, err
			}
		} else if m.opts.Forwards != nil {
			m.closeForward(s, req.Name)
		}
		rec, err := m.processDirective(ctx, conn, directiveProcessStart, map[string]any{"key": req.Name, "command": command, "targetPort": req.Port})
		if err != nil && opened {
			m.closeForward(s, req.Name)
		}
		return rec, err
	})
	if err != nil {
		return ipc.BgProcess{}, err
	}
	rec.Key, rec.TargetPort = req.Name, req.Port
	if rec.Command == "" {
		rec.Command = command
	}
	bg := store.Background{Name: req.Name, Command: command, TargetPort: req.Port, Forwarding: req.Port != 0, Started: command}
	if prev != nil {
		bg.LocalPort = prev.LocalPort
	}
	if info, ok := m.forwardOf(s, req.Name); ok && req.Port != 0 {
		bg.LocalPort = info.LocalPort
	}
	s = m.saveBackground(s, bg)
	m.publish(events.BackgroundStarted, s, map[string]any{"name": req.Name, "pid": rec.PID, "targetPort": req.Port})
	out := m.bgProcess(s, rec)
	if req.Port != 0 {
		return m.waitPort(ctx, s, rec, out)
	}
	return out, nil
}

// BgRestart syncs the working tree and restarts the named process with its
// command; its forward, if it had a port, is reopened on the same local port.
func (m *Manager) BgRestart(ctx context.Context, req ipc.BgRequest) (ipc.BgProcess, error) {
	s, p, err := m.bgSession(ctx, req.Target)
	if err != nil {
		return ipc.BgProcess{}, err
	}
	if s, p, err = m.bgCheckout(req.Target, s, p, true); err != nil {
		return ipc.BgProcess{}, err
	}
	known := findBackground(s, req.Name)
	rec, err := m.bgLocked(ctx, s, p, true, func(conn execer) (processRecord, error) {
		rec, err := m.processDirective(ctx, conn, directiveProcessRestart, map[string]any{"key": req.Name})
		if errdefs.KindOf(err) == errdefs.KindNotFound && known != nil && known.Started != "" {
			// The sandbox lost it (the remote restarted): started again
			// from what sandboxd recorded when it started it.
			return m.processDirective(ctx, conn, directiveProcessStart, map[string]any{"key": req.Name, "command": known.Started, "targetPort": known.TargetPort})
		}
		return rec, err
	})
	if err != nil {
		return ipc.BgProcess{}, err
	}
	rec.Key = req.Name
	prev := findBackground(s, req.Name)
	if prev != nil && prev.TargetPort != 0 {
		// The port forwarded is the one sandboxd started the process with,
		// not whatever the record names.
		rec.TargetPort = prev.TargetPort
	}
	bg := store.Background{Name: req.Name, Command: rec.Command, TargetPort: rec.TargetPort}
	if prev != nil {
		bg.LocalPort, bg.Started = prev.LocalPort, prev.Started
		if bg.Command == "" {
			bg.Command = prev.Command
		}
	}
	if rec.TargetPort != 0 && m.opts.Forwards != nil {
		if _, err := m.openForward(s, req.Name, rec.TargetPort, 0, prev); err != nil {
			s = m.saveBackground(s, bg)
			return m.bgProcess(s, rec), fmt.Errorf("the process restarted, but its port could not be forwarded: %w", err)
		}
		bg.Forwarding = true
		if info, ok := m.forwardOf(s, req.Name); ok {
			bg.LocalPort = info.LocalPort
		}
	}
	s = m.saveBackground(s, bg)
	m.publish(events.BackgroundStarted, s, map[string]any{"name": req.Name, "pid": rec.PID, "targetPort": rec.TargetPort, "restart": true})
	out := m.bgProcess(s, rec)
	if bg.Forwarding {
		return m.waitPort(ctx, s, rec, out)
	}
	return out, nil
}

// BgStop closes the process's forward and stops it (its whole process
// group).
func (m *Manager) BgStop(ctx context.Context, req ipc.BgRequest) (ipc.BgProcess, error) {
	s, _, err := m.bgSession(ctx, req.Target)
	if err != nil {
		return ipc.BgProcess{}, err
	}
	m.closeForward(s, req.Name)
	if bg := findBackground(s, req.Name); bg != nil && bg.Forwarding {
		cp := *bg
		cp.Forwarding = false
		s = m.saveBackground(s, cp)
	}
	conn, err := m.connect(ctx, s)
	if err != nil {
		return ipc.BgProcess{}, err
	}
	rec, err := m.processDirective(ctx, conn, directiveProcessStop, map[string]any{"key": req.Name})
	if err != nil {
		return ipc.BgProcess{}, err
	}
	m.publish(events.BackgroundStopped, s, map[string]any{"name": req.Name})
	return m.bgProcess(s, rec), nil
}

// BgList reports the processes sandboxd started in the caller's sandbox,
// each with its live status from the agent.
func (m *Manager) BgList(ctx context.Context, t ipc.BgListRequest) (ipc.BgListResponse, error) {
	s, _, err := m.bgSession(ctx, t)
	if err != nil {
		return ipc.BgListResponse{}, err
	}
	resp := ipc.BgListResponse{RunID: s.RunID, Processes: []ipc.BgProcess{}}
	conn, cerr := m.connect(ctx, s)
	var listed map[string]processRecord
	if cerr == nil {
		listed, _ = m.agentProcesses(ctx, conn)
	}
	for _, bg := range s.Background {
		rec := processRecord{Key: bg.Name, Command: bg.Command, TargetPort: bg.TargetPort, Status: "unknown"}
		var detail string
		if got, ok := listed[bg.Name]; ok {
			rec = got
			if rec.Command == "" {
				rec.Command = bg.Command
			}
			delete(listed, bg.Name)
		} else if cerr != nil {
			detail = cerr.Error()
		} else if got, err := m.processDirective(ctx, conn, directiveProcessStatus, map[string]any{"key": bg.Name}); errdefs.KindOf(err) == errdefs.KindNotFound {
			// The sandbox no longer knows it: it went with a restart of
			// the remote (or of the sandbox), and its forward leads
			// nowhere.
			rec.Status = "gone"
			detail = fmt.Sprintf("the sandbox no longer has it (the remote restarted?): `nook bg restart %s` starts it again", bg.Name)
		} else if err != nil {
			detail = err.Error()
		} else {
			rec = got
			rec.Key = bg.Name
			if rec.Command == "" {
				rec.Command = bg.Command
			}
		}
		p := m.bgProcess(s, rec)
		p.Detail = detail
		if rec.Status == "gone" && p.Forward != nil && p.Forward.State == "listening" {
			p.Forward.State, p.Forward.Error = "dead", "nothing behind it, the process is gone"
		}
		resp.Processes = append(resp.Processes, p)
	}
	// What another client (the RWX CLI) started, in the agent's order.
	resp.Processes = append(resp.Processes, m.othersProcesses(s, listed)...)
	return resp, nil
}

// BgLogs writes the process's stdout and stderr log files; with Follow it
// keeps following both (tail -F in the sandbox) until ctx ends.
func (m *Manager) BgLogs(ctx context.Context, req ipc.BgRequest, stdout, stderr io.Writer) (ipc.BgProcess, error) {
	s, _, err := m.bgSession(ctx, req.Target)
	if err != nil {
		return ipc.BgProcess{}, err
	}
	conn, err := m.connect(ctx, s)
	if err != nil {
		return ipc.BgProcess{}, err
	}
	rec, err := m.processDirective(ctx, conn, directiveProcessLogs, map[string]any{"key": req.Name})
	if err != nil {
		return ipc.BgProcess{}, err
	}
	out := m.bgProcess(s, rec)
	if rec.StdoutPath == "" || rec.StderrPath == "" {
		return out, errdefs.Unavailable(fmt.Errorf("the sandbox did not say where the logs of %q are", req.Name))
	}
	show := func(path string, w io.Writer) error {
		cmd := "cat -- " + shellQuote([]string{path})
		if req.Follow {
			cmd = "exec tail -n +1 -F -- " + shellQuote([]string{path}) + " 2>/dev/null"
		}
		st, err := conn.Exec(ctx, cmd, sshpool.Stdio{Stdout: w})
		if err != nil {
			if ctx.Err() != nil && req.Follow {
				return nil // the client stopped following
			}
			return errdefs.Unavailable(fmt.Errorf("read the logs of %q: %w", req.Name, err))
		}
		if st.Code != 0 && !req.Follow {
			return errdefs.Unavailable(fmt.Errorf("read %s in the sandbox: exit %d", path, st.Code))
		}
		return nil
	}
	if !req.Follow {
		if err := show(rec.StdoutPath, stdout); err != nil {
			return out, err
		}
		return out, show(rec.StderrPath, stderr)
	}
	errs := make(chan error, 2)
	go func() { errs <- show(rec.StdoutPath, stdout) }()
	go func() { errs <- show(rec.StderrPath, stderr) }()
	return out, errors.Join(<-errs, <-errs)
}

// bgLocked runs fn with the sandbox's turn and agent lock held, after
// syncing the working tree when asked (what a background process serves
// must be the latest local state).
func (m *Manager) bgLocked(ctx context.Context, s *store.Session, p place, doSync bool, fn func(execer) (processRecord, error)) (processRecord, error) {
	release, err := m.sandboxOf(s).line.Acquire(ctx, func(int) {})
	if err != nil {
		return processRecord{}, errdefs.Canceled(fmt.Errorf("waiting for the sandbox: %w", err))
	}
	defer release()
	// The agent lock is leased as for an exec (released after a short
	// idle time, never on this caller's path).
	conn, leaseDone, err := m.lockSandbox(ctx, s)
	if err != nil {
		return processRecord{}, err
	}
	defer leaseDone()
	lc := &sshpool.Locked{Conn: conn, Relock: func(ctx context.Context) (*sshpool.Conn, error) { return m.relock(ctx, s) }}
	if doSync && p.RepoRoot != "" && p.RepoRoot == s.RepoRoot {
		// No pull follows: push only, so what the process writes is not
		// taken for an exec's edits.
		m.mark(ctx, lc, directiveSyncStart)
		_, err := m.push(ctx, m.runner(lc), s, true, func(w string) { m.log.Info("sync before a background process", "run", s.RunID, "warning", w) })
		m.mark(ctx, lc, directiveSyncEnd)
		if err != nil {
			return processRecord{}, err
		}
	}
	return fn(lc)
}

// execer runs one command in the sandbox: a pool connection
// (*sshpool.Conn) or the one holding the agent lock (*sshpool.Locked).
type execer interface {
	Exec(ctx context.Context, command string, stdio sshpool.Stdio) (sshpool.ExitStatus, error)
}

// processDirective sends one managed-process directive and decodes the
// agent's record, bounded in size and time and checked before use (see
// processRecord.validate).
func (m *Manager) processDirective(ctx context.Context, conn execer, name string, req map[string]any) (processRecord, error) {
	payload, err := json.Marshal(req)
	if err != nil {
		return processRecord{}, errdefs.Internal(fmt.Errorf("encode the %s request: %w", name, err))
	}
	key, _ := req["key"].(string)
	ctx, cancel := context.WithTimeout(ctx, processDirectiveWait)
	defer cancel()
	stdout, stderr := newAnswer(processRecordMax), newAnswer(processErrorMax)
	stdout.onOver = cancel // no record is that long: stop the agent's flood
	st, err := conn.Exec(ctx, name+" "+string(payload), sshpool.Stdio{Stdout: stdout, Stderr: stderr})
	if stdout.over {
		return processRecord{}, errdefs.Unavailable(fmt.Errorf("the sandbox agent's answer to %s for %q is over %d bytes: refused (a process record is small)", name, key, processRecordMax))
	}
	if err != nil {
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return processRecord{}, errdefs.Unavailable(fmt.Errorf("the sandbox agent did not answer %s for %q within %s: %w", name, key, processDirectiveWait, err))
		}
		return processRecord{}, errdefs.Unavailable(fmt.Errorf("ask the sandbox agent: %w", err))
	}
	msg := printable(strings.TrimSpace(stderr.String()), 1024)
	switch {
	case st.Code == 127:
		return processRecord{}, errdefs.Unavailable(errors.New("background processes are not supported by this sandbox's agent"))
	case st.Code != 0 || st.Signal != "":
		if msg == "" {
			msg = fmt.Sprintf("exit %d", st.Code)
		}
		msg = strings.TrimPrefix(msg, "sandboxd-localcloud: ")
		if strings.Contains(msg, "no background process named") {
			return processRecord{}, errdefs.NotFound(fmt.Errorf("the sandbox agent: %s", msg))
		}
		return processRecord{}, errdefs.Unavailable(fmt.Errorf("the sandbox agent refused: %s", msg))
	}
	var rec processRecord
	dec := json.NewDecoder(bytes.NewReader(stdout.Bytes()))
	if err := dec.Decode(&rec); err != nil {
		return processRecord{}, errdefs.Unavailable(fmt.Errorf("the sandbox agent's answer is not a process record (%q): %w", printable(stdout.String(), 256), err))
	}
	if _, err := dec.Token(); err != io.EOF {
		return processRecord{}, errdefs.Unavailable(fmt.Errorf("the sandbox agent's answer to %s holds more than one process record: refused", name))
	}
	if err := rec.validate(key); err != nil {
		return processRecord{}, errdefs.Unavailable(fmt.Errorf("the sandbox agent's process record for %q is refused: %w", key, err))
	}
	return rec, nil
}

// waitPort waits until the process listens on its port in the sandbox, or
// has ended (an error naming its logs), or 30s have passed (the process and
// forward are kept: it may just be slow).
func (m *Manager) waitPort(ctx context.Context, s *store.Session, rec processRecord, out ipc.BgProcess) (ipc.BgProcess, error) {
	deadline := m.now().Add(portReadyTimeout)
	for {
		dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		nc, err := m.DialSandbox(dctx, s.RunID, rec.TargetPort)
		cancel()
		if err == nil {
			nc.Close()
			return out, nil
		}
		conn, cerr := m.connect(ctx, s)
		if cerr != nil {
			return out, cerr
		}
		st, serr := m.processDirective(ctx, conn, directiveProcessStatus, map[string]any{"key": rec.Key})
		if serr != nil {
			return out, serr
		}
		if st.Status != "running" {
			m.closeForward(s, rec.Key)
			return m.bgProcess(s, st), errdefs.Conflict(fmt.Errorf("background process %q ended (%s) before port %d was ready: see `nook bg logs %s`", rec.Key, describeEnd(st), rec.TargetPort, rec.Key))
		}
		if m.now().After(deadline) {
			out.Detail = fmt.Sprintf("port %d did not answer within %s; the process and the forward are kept", rec.TargetPort, portReadyTimeout)
			return out, nil
		}
		select {
		case <-ctx.Done():
			return out, errdefs.Canceled(fmt.Errorf("waiting for port %d: %w", rec.TargetPort, ctx.Err()))
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func describeEnd(r processRecord) string {
	switch {
	case r.Signal != "":
		return r.Status + ", signal " + r.Signal
	case r.ExitCode != nil:
		return r.Status + ", exit code " + strconv.Itoa(*r.ExitCode)
	}
	return r.Status
}

// DialSandbox reaches a port on the loopback of the sandbox of run runID
// through the daemon's kept connection (following an agent that moved).
func (m *Manager) DialSandbox(ctx context.Context, runID string, port int) (net.Conn, error) {
	s, err := m.st.ByRunID(runID)
	if err != nil {
		return nil, fmt.Errorf("forward to run %s: %w", runID, err)
	}
	if s.State.Terminal() {
		return nil, endedError(s)
	}
	m.awaitCheck(ctx, s.ID)
	if cur, err := m.st.Get(s.ID); err == nil {
		s = cur
	}
	conn, err := m.connect(ctx, s)
	if err != nil {
		return nil, err
	}
	nc, err := conn.Dial(ctx, net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return nil, errdefs.Unavailable(err)
	}
	// Forward traffic is a use of the sandbox (idle stop).
	id := s.ID
	m.touch(id)
	return &touchConn{Conn: nc, touch: func() { m.touch(id) }}, nil
}

// openForward opens (or keeps) the forward of name to port. Without an
// explicit local port it reuses the previous one of that name when free,
// else the sandbox's port number when free (`curl :8000` reaches port
// 8000), else any free port. It reports whether it opened a new forward.
func (m *Manager) openForward(s *store.Session, name string, port, localPort int, prev *store.Background) (bool, error) {
	_, had := m.sandboxOf(s).fwds.Get(name)
	spec := forward.Spec{RunID: s.RunID, Name: name, TargetPort: port, LocalPort: localPort}
	if localPort == 0 && prev != nil && prev.LocalPort != 0 {
		spec.LocalPort = prev.LocalPort
		if info, err := m.sandboxOf(s).fwds.Open(spec); err == nil {
			m.forwardOpened(s, info)
			return !had, nil
		}
		spec.LocalPort = 0
	}
	if localPort == 0 && (prev == nil || prev.LocalPort == 0) {
		spec.LocalPort = port
		if info, err := m.sandboxOf(s).fwds.Open(spec); err == nil {
			m.forwardOpened(s, info)
			return !had, nil
		}
		spec.LocalPort = 0
	}
	info, err := m.sandboxOf(s).fwds.Open(spec)
	if err != nil {
		return false, err
	}
	m.forwardOpened(s, info)
	return !had, nil
}

func (m *Manager) forwardOpened(s *store.Session, info forward.Info) {
	m.sandboxOf(s).setForwardFailed(info.Name, "")
	m.publish(events.ForwardOpened, s, map[string]any{"name": info.Name, "localPort": info.LocalPort, "targetPort": info.TargetPort, "url": info.URL()})
}

func (m *Manager) closeForward(s *store.Session, name string) {
	if m.opts.Forwards == nil {
		return
	}
	m.sandboxOf(s).setForwardFailed(name, "")
	if m.sandboxOf(s).fwds.Close(name) {
		m.publish(events.ForwardClosed, s, map[string]any{"name": name})
	}
}

func (m *Manager) forwardOf(s *store.Session, name string) (forward.Info, bool) {
	c := m.sandboxIfAny(s.ID)
	if c == nil || c.fwds == nil {
		return forward.Info{}, false
	}
	return c.fwds.Get(name)
}

// closeRunForwards closes the forwards of a session that ended.
func (m *Manager) closeRunForwards(s *store.Session) {
	c := m.sandboxIfAny(s.ID)
	if c == nil || c.fwds == nil {
		return
	}
	for _, info := range c.fwds.CloseAll() {
		m.publish(events.ForwardClosed, s, map[string]any{"name": info.Name, "reason": "the sandbox ended"})
	}
}

// restoreForwards reopens the forwards of the live sessions (after a
// daemon restart) on their local ports. A port that is taken now is
// reported in `nook list` and events, and retried on the next start or
// restart of the process.
func (m *Manager) restoreForwards(live []*store.Session) {
	if m.opts.Forwards == nil {
		return
	}
	for _, s := range live {
		for _, bg := range s.Background {
			if !bg.Forwarding || bg.TargetPort == 0 {
				continue
			}
			info, err := m.sandboxOf(s).fwds.Open(forward.Spec{RunID: s.RunID, Name: bg.Name, TargetPort: bg.TargetPort, LocalPort: bg.LocalPort})
			if err != nil {
				m.sandboxOf(s).setForwardFailed(bg.Name, err.Error())
				m.log.Warn("restore port forward", "run", s.RunID, "name", bg.Name, "local", bg.LocalPort, "err", err)
				m.publish(events.ForwardFailed, s, map[string]any{"name": bg.Name, "localPort": bg.LocalPort, "targetPort": bg.TargetPort, "error": err.Error()})
				continue
			}
			m.forwardOpened(s, info)
		}
	}
}

// forwardInfos is the public view of a session's forwards.
func (m *Manager) forwardInfos(s *store.Session) []ipc.Forward {
	var out []ipc.Forward
	for _, bg := range s.Background {
		if bg.Forwarding {
			out = append(out, m.forwardView(s, bg))
		}
	}
	return out
}

func (m *Manager) forwardView(s *store.Session, bg store.Background) ipc.Forward {
	f := ipc.Forward{Name: bg.Name, LocalPort: bg.LocalPort, TargetPort: bg.TargetPort}
	if info, ok := m.forwardOf(s, bg.Name); ok && !s.State.Terminal() {
		f.LocalPort, f.TargetPort, f.State = info.LocalPort, info.TargetPort, "listening"
	} else {
		f.State = "failed"
		f.Error = m.sandboxIfAny(s.ID).forwardFailure(bg.Name)
		if f.Error == "" {
			f.Error = "not listening"
			if s.State.Terminal() {
				f.Error = "the sandbox ended"
			}
		}
	}
	if f.LocalPort != 0 {
		f.URL = "http://127.0.0.1:" + strconv.Itoa(f.LocalPort)
	}
	return f
}

func (m *Manager) bgProcess(s *store.Session, r processRecord) ipc.BgProcess {
	p := ipc.BgProcess{
		RunID: s.RunID, Name: r.Key, Status: r.Status, Command: r.Command, PID: r.PID, PGID: r.PGID,
		StartedAt: r.StartedAt, CompletedAt: r.CompletedAt, ExitCode: r.ExitCode, Signal: r.Signal,
		StdoutPath: r.StdoutPath, StderrPath: r.StderrPath,
	}
	if bg := findBackground(s, r.Key); bg != nil && bg.Forwarding {
		f := m.forwardView(s, *bg)
		p.Forward = &f
	}
	return p
}

func findBackground(s *store.Session, name string) *store.Background {
	for i := range s.Background {
		if s.Background[i].Name == name {
			return &s.Background[i]
		}
	}
	return nil
}

// saveBackground records bg in the session (replacing the one of its name)
// and returns the updated session.
func (m *Manager) saveBackground(s *store.Session, bg store.Background) *store.Session {
	updated, err := m.st.Update(s.ID, func(cur *store.Session) error {
		for i := range cur.Background {
			if cur.Background[i].Name == bg.Name {
				cur.Background[i] = bg
				return nil
			}
		}
		cur.Background = append(cur.Background, bg)
		return nil
	})
	if err != nil {
		m.log.Warn("record a background process", "session", s.ID, "name", bg.Name, "err", err)
		return s
	}
	return updated
}

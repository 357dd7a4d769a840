package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/crypto/ssh"
)

// session is one SSH session channel: at most one exec or shell.
type session struct {
	conn *connState
	ch   ssh.Channel
	q    *reqQueue

	mu      sync.Mutex
	env     []string
	pty     *ptyRequest
	master  *os.File // pty master once the command runs on a pty
	started bool
	exited  bool
	pid     int              // process group of the running command; 0 when none
	pending []syscall.Signal // signals that came before the process started
}

type ptyRequest struct {
	Term          string
	Columns, Rows uint32
	Width, Height uint32
	Modes         string
}

type windowChange struct {
	Columns, Rows uint32
	Width, Height uint32
}

func (s *session) serve(ctx context.Context, reqs <-chan *ssh.Request) {
	a := s.conn.agent
	a.busy.Add(1)
	a.activity()
	defer func() {
		a.busy.Add(-1)
		a.activity()
	}()
	// ctx ends when the channel is closed by either side or the connection
	// goes away: lock waits give up and running commands are hung up.
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		<-ctx.Done()
		s.hangUp()
	}()
	q := s.q
	var running sync.WaitGroup
	for {
		req, more := q.next()
		if !more {
			break
		}
		ok, then := s.handle(req)
		q.handled.Add(1)
		if req.WantReply {
			_ = req.Reply(ok, nil)
		}
		if then != nil {
			// Started only after the reply: a fast directive must not
			// close the channel before the client saw its exec accepted.
			running.Add(1)
			go func() {
				defer running.Done()
				then(ctx)
			}()
		}
	}
	cancel()
	running.Wait()
	s.ch.Close()
}

// handle answers one channel request; for exec and shell it also returns
// the work to start once the request is answered.
func (s *session) handle(req *ssh.Request) (bool, func(context.Context)) {
	switch req.Type {
	case "env":
		var kv struct{ Name, Value string }
		if ssh.Unmarshal(req.Payload, &kv) != nil || kv.Name == "" || strings.ContainsAny(kv.Name, "=\x00") {
			return false, nil
		}
		s.mu.Lock()
		s.env = append(s.env, kv.Name+"="+kv.Value)
		s.mu.Unlock()
		return true, nil
	case "pty-req":
		var p ptyRequest
		if ssh.Unmarshal(req.Payload, &p) != nil {
			return false, nil
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.started {
			return false, nil
		}
		s.pty = &p
		return true, nil
	case "window-change":
		var w windowChange
		if ssh.Unmarshal(req.Payload, &w) != nil {
			return false, nil
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.pty != nil {
			s.pty.Columns, s.pty.Rows = w.Columns, w.Rows
		}
		if s.master != nil {
			_ = setWinsize(s.master, w.Columns, w.Rows)
		}
		return true, nil
	case "exec", "shell":
		s.conn.execRequests.Add(1)
		s.conn.agent.total.execRequests.Add(1)
		var command string
		if req.Type == "exec" {
			var p struct{ Command string }
			if ssh.Unmarshal(req.Payload, &p) != nil {
				return false, nil
			}
			command = p.Command
			s.conn.agent.markSync(s.conn, s.q, command)
		}
		s.mu.Lock()
		if s.started {
			s.mu.Unlock()
			return false, nil
		}
		s.started = true
		s.mu.Unlock()
		kind := runExec
		if req.Type == "shell" {
			kind = runShell
		}
		return true, func(ctx context.Context) { s.run(ctx, kind, command) }
	case "subsystem":
		var p struct{ Name string }
		if ssh.Unmarshal(req.Payload, &p) != nil || p.Name != "sftp" {
			return false, nil
		}
		s.conn.execRequests.Add(1)
		s.conn.agent.total.execRequests.Add(1)
		s.mu.Lock()
		if s.started {
			s.mu.Unlock()
			return false, nil
		}
		s.started = true
		s.mu.Unlock()
		return true, func(ctx context.Context) { s.run(ctx, runSFTP, "") }
	case "signal":
		var p struct{ Signal string }
		if ssh.Unmarshal(req.Payload, &p) != nil {
			return false, nil
		}
		sig, ok := signalsByName[p.Signal]
		if !ok {
			return false, nil
		}
		return s.signal(sig) == nil, nil
	case "keepalive@openssh.com":
		return true, nil
	default:
		return false, nil
	}
}

// What a session runs.
const (
	runExec  = iota // a command (or a directive)
	runShell        // the interactive login shell
	runSFTP         // the sftp subsystem
)

// DefaultSFTPServers are where distributions put OpenSSH's sftp-server
// (Debian and Ubuntu: package openssh-sftp-server; Fedora; Arch; macOS).
var DefaultSFTPServers = []string{"/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server",
	"/usr/lib/ssh/sftp-server", "/usr/libexec/sftp-server", "/usr/local/libexec/sftp-server"}

// sftpScript runs the first sftp-server of paths (then of $PATH) found in
// the sandbox, as a command; it says what to install when there is none.
func sftpScript(paths []string) string {
	var b strings.Builder
	b.WriteString("for p in")
	for _, p := range paths {
		b.WriteString(" '" + strings.ReplaceAll(p, "'", `'\''`) + "'")
	}
	b.WriteString(`; do [ -x "$p" ] && exec "$p"; done
p=$(command -v sftp-server) && exec "$p"
echo "sandboxd-localcloud: the sftp subsystem needs OpenSSH's sftp-server in the sandbox, and there is none: install it (Debian, Ubuntu: apt-get install openssh-sftp-server), or use scp -O (the classic protocol, over a command)" >&2
exit 127`)
	return b.String()
}

// run executes a directive, a command, a shell or a subsystem, then
// reports its exit and closes the channel.
func (s *session) run(ctx context.Context, kind int, command string) {
	a := s.conn.agent
	shell := kind == runShell
	switch kind {
	case runSFTP:
		a.logCommand(s.conn, "$ (sftp)")
		paths := a.cfg.SFTPServers
		if paths == nil {
			paths = DefaultSFTPServers
		}
		command = sftpScript(paths)
	case runExec:
		if handled := s.directive(ctx, strings.TrimSpace(command)); handled {
			return
		}
		a.logCommand(s.conn, "$ "+command)
		if git, ok, err := a.gitCommand(command); ok {
			if err != nil {
				fmt.Fprintf(s.ch.Stderr(), "sandboxd-localcloud: %v\n", err)
				_ = s.ch.CloseWrite()
				s.exit(128)
				s.ch.Close()
				return
			}
			command = git
		}
	case runShell:
		a.logCommand(s.conn, "$ (interactive shell)")
	}
	status, sig, err := s.runProcess(shell, command)
	if err != nil {
		fmt.Fprintf(s.ch.Stderr(), "sandboxd-localcloud: %v\n", err)
	}
	_ = s.ch.CloseWrite()
	if sig != "" {
		_, _ = s.ch.SendRequest("exit-signal", false, ssh.Marshal(struct {
			Signal     string
			CoreDumped bool
			Error      string
			Lang       string
		}{Signal: sig}))
	} else {
		s.exit(status)
	}
	s.ch.Close()
}

// directive answers the agent's own commands; it reports false for
// anything else. Directives print nothing.
func (s *session) directive(ctx context.Context, command string) bool {
	a := s.conn.agent
	switch command {
	case DirectiveLockRequested:
		if err := a.lock.acquire(ctx, s.conn.id); err != nil {
			s.ch.Close() // the client went away while waiting
			return true
		}
	case DirectiveLockReleased:
		a.lock.release(s.conn.id)
	case DirectiveSyncStart, DirectiveSyncEnd:
		// Applied when the request was read (markSync).
	case DirectiveEnd:
		a.logCommand(s.conn, "sandbox ended by the client")
		s.exit(0)
		s.ch.Close()
		a.end()
		return true
	default:
		return s.processDirective(command)
	}
	s.exit(0)
	s.ch.Close()
	return true
}

func (s *session) exit(status int) {
	_, _ = s.ch.SendRequest("exit-status", false, ssh.Marshal(struct{ Status uint32 }{uint32(status)}))
}

// runProcess runs the command in its own process group (or session, on a
// pty) and returns its exit status or the name of the signal that killed
// it.
func (s *session) runProcess(shell bool, command string) (status int, signal string, err error) {
	a := s.conn.agent
	args := []string{"/bin/sh", "-c", command}
	if shell {
		args = []string{loginShell(), "-i"}
	}
	s.mu.Lock()
	env := append(append([]string{}, a.cfg.Env...), s.env...)
	var p *ptyRequest
	if s.pty != nil {
		cp := *s.pty // window-change updates s.pty concurrently
		p = &cp
	}
	s.mu.Unlock()
	var cmd *exec.Cmd
	if p != nil {
		cmd = a.terminalCommand(args...)
	} else {
		cmd = a.command(args...)
	}
	if p != nil {
		term := p.Term
		if term == "" {
			term = "xterm"
		}
		env = append(env, "TERM="+term)
	}
	cmd.Env = env
	cmd.WaitDelay = a.cfg.OutputGrace

	var master, tty *os.File
	if p != nil {
		master, tty, err = openPTY(a.devRoot())
		if err != nil {
			return 1, "", fmt.Errorf("allocate a terminal: %w", err)
		}
		defer master.Close()
		_ = setWinsize(tty, p.Columns, p.Rows)
		cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
		cmd.SysProcAttr = dieWithServer(cmd.SysProcAttr) // a new session, the terminal its own
	} else {
		stdin, perr := cmd.StdinPipe()
		if perr != nil {
			return 1, "", fmt.Errorf("set up stdin: %w", perr)
		}
		go func() {
			// Not waited for: a client that never closes stdin must not
			// keep the exit status from being sent.
			_, _ = io.Copy(stdin, s.ch)
			stdin.Close()
		}()
		cmd.Stdout, cmd.Stderr = s.ch, s.ch.Stderr()
		cmd.SysProcAttr = dieWithServer(&syscall.SysProcAttr{Setpgid: true})
	}
	if err := cmd.Start(); err != nil {
		if tty != nil {
			tty.Close()
		}
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ENOENT) {
			return 127, "", fmt.Errorf("start %s in %s: %w", args[0], a.cfg.Workspace, err)
		}
		return 126, "", fmt.Errorf("start %s in %s: %w", args[0], a.cfg.Workspace, err)
	}
	s.mu.Lock()
	s.pid = cmd.Process.Pid
	for _, sig := range s.pending {
		_ = syscall.Kill(-s.pid, sig)
	}
	s.pending = nil
	s.mu.Unlock()
	var copied sync.WaitGroup
	if master != nil {
		tty.Close()
		s.mu.Lock()
		s.master = master
		_ = setWinsize(master, s.pty.Columns, s.pty.Rows) // a resize may have come during the start
		s.mu.Unlock()
		copied.Add(1)
		go func() {
			defer copied.Done()
			_, _ = io.Copy(s.ch, master) // ends with EIO once the terminal hangs up
		}()
		go func() { _, _ = io.Copy(master, s.ch) }()
	}
	werr := cmd.Wait()
	copied.Wait()
	s.mu.Lock()
	s.pid, s.exited = 0, true
	s.master = nil
	s.mu.Unlock()
	ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
	if !ok {
		return 1, "", fmt.Errorf("wait for the command: %w", werr)
	}
	if ws.Signaled() {
		if name := signalName(ws.Signal()); name != "" {
			return 0, name, nil
		}
		return 128 + int(ws.Signal()), "", nil
	}
	return ws.ExitStatus(), "", nil
}

// signal delivers sig to the running command's whole process group.
func (s *session) signal(sig syscall.Signal) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pid == 0 {
		if s.started && !s.exited {
			// Exec accepted, process not started yet: deliver on start.
			s.pending = append(s.pending, sig)
			return nil
		}
		return errors.New("no command is running")
	}
	if s.master != nil {
		// On a terminal the command leads a session of its own, made
		// inside the sandbox (terminalCommand), apart from s.pid's group
		// (what entered the namespaces). The signal goes to it alone:
		// the process outside then ends as it does, after reaping it.
		if sid, err := terminalSession(s.master); err == nil && sid > 0 && sid != s.pid {
			return syscall.Kill(-sid, sig)
		}
	}
	return syscall.Kill(-s.pid, sig)
}

// hangUp sends SIGHUP to a command whose client went away, as a terminal
// hangup would.
func (s *session) hangUp() {
	_ = s.signal(syscall.SIGHUP)
}

func loginShell() string {
	for _, sh := range []string{"/bin/bash", "/bin/sh"} {
		if st, err := os.Stat(sh); err == nil && st.Mode()&0o111 != 0 {
			return sh
		}
	}
	return "/bin/sh"
}

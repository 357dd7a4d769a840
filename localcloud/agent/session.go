package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

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
	proc    process          // the running command; nil when none
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
		return s.processListDirective(command) || s.processDirective(command)
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
	if p != nil {
		term := p.Term
		if term == "" {
			term = "xterm"
		}
		env = append(env, "TERM="+term)
	}

	var stdio, ours [3]*os.File // the command's ends, and ours without a terminal
	var master *os.File
	if p != nil {
		var tty *os.File
		master, tty, err = openPTY(a.devRoot())
		if err != nil {
			return 1, "", fmt.Errorf("allocate a terminal: %w", err)
		}
		defer master.Close()
		_ = setWinsize(tty, p.Columns, p.Rows)
		stdio = [3]*os.File{tty, tty, tty}
	} else if stdio, ours, err = pipes(); err != nil {
		return 1, "", fmt.Errorf("set up the command's stdin, stdout and stderr: %w", err)
	}
	proc, err := a.launch(args, env, p != nil, stdio, master)
	closeFiles(stdio[:]) // the command has them: EOF and hangups depend on it
	if err != nil {
		closeFiles(ours[:])
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ENOENT) {
			return 127, "", err
		}
		return 126, "", err
	}
	defer proc.release()
	s.mu.Lock()
	s.proc = proc
	for _, sig := range s.pending {
		_ = proc.signal(sig)
	}
	s.pending = nil
	if master != nil {
		s.master = master
		_ = setWinsize(master, s.pty.Columns, s.pty.Rows) // a resize may have come during the start
	}
	s.mu.Unlock()
	var copied sync.WaitGroup // the command's output, to the client
	if master != nil {
		copied.Add(1)
		go func() {
			defer copied.Done()
			_, _ = io.Copy(s.ch, master) // ends with EIO once the terminal hangs up
		}()
		go func() { _, _ = io.Copy(master, s.ch) }()
	} else {
		stdin, stdout, stderr := ours[0], ours[1], ours[2]
		go func() {
			// Not waited for: a client that never closes stdin must not
			// keep the exit status from being sent.
			_, _ = io.Copy(stdin, s.ch)
			stdin.Close()
		}()
		copied.Add(2)
		go func() {
			defer copied.Done()
			_, _ = io.Copy(s.ch, stdout)
		}()
		go func() {
			defer copied.Done()
			_, _ = io.Copy(s.ch.Stderr(), stderr)
		}()
	}
	exit, werr := proc.wait()
	if master != nil {
		copied.Wait()
	} else {
		ours[0].Close()
		// What the command left running may hold its stdout or stderr
		// open: its output is waited for OutputGrace, not for ever.
		if !waitFor(&copied, a.cfg.OutputGrace) {
			closeFiles(ours[1:])
			copied.Wait()
		}
		closeFiles(ours[1:])
	}
	s.mu.Lock()
	s.proc, s.exited = nil, true
	s.master = nil
	s.mu.Unlock()
	if werr != nil {
		return 1, "", werr
	}
	if exit.Signal != 0 {
		if name := signalName(exit.Signal); name != "" {
			return 0, name, nil
		}
		return 128 + int(exit.Signal), "", nil
	}
	return exit.Code, "", nil
}

// pipes makes a command's stdin, stdout and stderr: its ends and ours.
func pipes() (theirs, ours [3]*os.File, err error) {
	for i := range 3 {
		r, w, err := os.Pipe()
		if err != nil {
			closeFiles(theirs[:])
			closeFiles(ours[:])
			return theirs, ours, err
		}
		if i == 0 {
			theirs[i], ours[i] = r, w
		} else {
			theirs[i], ours[i] = w, r
		}
	}
	return theirs, ours, nil
}

func closeFiles(fs []*os.File) {
	for _, f := range fs {
		if f != nil {
			f.Close()
		}
	}
}

// waitFor waits for wg at most d; false when d ran out.
func waitFor(wg *sync.WaitGroup, d time.Duration) bool {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
		return true
	case <-t.C:
		return false
	}
}

// signal delivers sig to the running command's whole process group.
func (s *session) signal(sig syscall.Signal) error {
	s.mu.Lock()
	proc := s.proc
	if proc == nil {
		defer s.mu.Unlock()
		if s.started && !s.exited {
			// Exec accepted, process not started yet: deliver on start.
			s.pending = append(s.pending, sig)
			return nil
		}
		return errors.New("no command is running")
	}
	s.mu.Unlock()
	return proc.signal(sig)
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

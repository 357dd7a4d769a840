package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"

	"github.com/sandboxd/sandboxd/localcloud/spawner"
)

// spawnTimeout bounds a spawner's answer to a command (it answers once it
// forked; the first command also waits for the spawner to start); a stuck
// one is replaced.
const spawnTimeout = 10 * time.Second

// spawningSandbox is a sandbox with a spawner inside (package
// localcloud/sandbox): commands are forked there instead of entering the
// sandbox each.
type spawningSandbox interface {
	Spawn(ctx context.Context, req spawner.Request, stdio [3]*os.File) (*spawner.Process, error)
}

// process is a started command.
type process interface {
	// signal delivers sig to the command's process group (on a terminal,
	// its session's).
	signal(sig syscall.Signal) error
	// wait returns how the command ended; an error when that is not
	// known.
	wait() (spawner.Exit, error)
	// release lets what the command left behind go: signals no longer
	// reach its group.
	release()
}

// launch starts argv in the workspace with stdio as its stdin,
// stdout and stderr (a terminal, when terminal is set: the command leads
// a new session whose controlling terminal that is). master is the
// terminal's other side, if any. The caller closes its copies of stdio.
func (a *Agent) launch(argv, env []string, terminal bool, stdio [3]*os.File, master *os.File) (process, error) {
	if sp, ok := a.cfg.Sandbox.(spawningSandbox); ok {
		ctx, cancel := context.WithTimeout(a.ctx, spawnTimeout)
		p, err := sp.Spawn(ctx, spawner.Request{Argv: argv, Env: env, Dir: a.cfg.Workspace, Terminal: terminal}, stdio)
		cancel()
		if err == nil {
			return spawnedProcess{p}, nil
		}
		if !errors.Is(err, spawner.ErrUnavailable) {
			return nil, err
		}
		// Not started: through the entering chain.
		a.log.Debug("command not run by the sandbox's spawner", "err", err)
	}
	var cmd *exec.Cmd
	if terminal {
		cmd = a.terminalCommand(argv...)
	} else {
		// Its own session (and so group), without a controlling
		// terminal: never localcloud's.
		cmd = a.command(argv...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	}
	cmd.SysProcAttr = dieWithServer(cmd.SysProcAttr)
	cmd.Env = env
	// Files: the command writes them itself, and Wait returns when it
	// exits (the caller copies and bounds the output).
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdio[0], stdio[1], stdio[2]
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s in %s: %w", argv[0], a.cfg.Workspace, err)
	}
	return &cmdProcess{cmd: cmd, master: master}, nil
}

// spawnedProcess is a command the sandbox's spawner forked.
type spawnedProcess struct{ p *spawner.Process }

func (s spawnedProcess) signal(sig syscall.Signal) error { return s.p.Signal(sig) }
func (s spawnedProcess) wait() (spawner.Exit, error)     { return s.p.Wait() }
func (s spawnedProcess) release()                        { s.p.Close() }

// cmdProcess is a command started from here (no sandbox, or through the
// entering chain).
type cmdProcess struct {
	cmd    *exec.Cmd
	master *os.File
}

func (c *cmdProcess) signal(sig syscall.Signal) error {
	pid := c.cmd.Process.Pid
	if c.master != nil {
		// On a terminal the command leads a session of its own, made
		// inside the sandbox (terminalCommand), apart from pid's group
		// (what entered the namespaces). The signal goes to it alone:
		// the process outside then ends as it does, after reaping it.
		if sid, err := terminalSession(c.master); err == nil && sid > 0 && sid != pid {
			return syscall.Kill(-sid, sig)
		}
	}
	return syscall.Kill(-pid, sig)
}

func (c *cmdProcess) wait() (spawner.Exit, error) {
	werr := c.cmd.Wait()
	ws, ok := c.cmd.ProcessState.Sys().(syscall.WaitStatus)
	if !ok {
		return spawner.Exit{}, fmt.Errorf("wait for the command: %w", werr)
	}
	if ws.Signaled() {
		return spawner.Exit{Signal: ws.Signal()}, nil
	}
	return spawner.Exit{Code: ws.ExitStatus()}, nil
}

func (c *cmdProcess) release() {}

package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Managed-process directives (RWX CLI `sandbox background`): exec requests
// whose command is the directive, a space and a JSON request. Each answers
// one JSON process record on stdout and exits 0, or prints why on stderr and
// exits 1.
const (
	DirectiveProcessStart   = "__rwx_sandbox_process_start__"
	DirectiveProcessRestart = "__rwx_sandbox_process_restart__"
	DirectiveProcessStop    = "__rwx_sandbox_process_stop__"
	DirectiveProcessStatus  = "__rwx_sandbox_process_status__"
	DirectiveProcessLogs    = "__rwx_sandbox_process_logs__"
)

// Process statuses. Clients treat anything but running as "not serving".
const (
	ProcessRunning = "running"
	ProcessExited  = "exited"  // ended by itself (exitCode or signal set)
	ProcessStopped = "stopped" // ended by a stop directive, a replace or the run's end
)

// processKeyLimit is the CLI's limit on background process names.
const processKeyLimit = 255

// ProcessRecord is the JSON answer of every managed-process directive, with
// the CLI's field names.
type ProcessRecord struct {
	Key         string `json:"key"`
	Status      string `json:"status"`
	TargetPort  int    `json:"targetPort,omitempty"`
	PID         int    `json:"pid"`
	PGID        int    `json:"pgid"`
	Command     string `json:"command"`
	StartedAt   string `json:"startedAt"`
	CompletedAt string `json:"completedAt,omitempty"`
	ExitCode    *int   `json:"exitCode,omitempty"`
	Signal      string `json:"signal,omitempty"`
	StdoutPath  string `json:"stdoutPath"`
	StderrPath  string `json:"stderrPath"`
}

// processRequest is the JSON argument of the directives (start uses all
// fields, the others only key).
type processRequest struct {
	Key        string `json:"key"`
	Command    string `json:"command"`
	TargetPort int    `json:"targetPort"`
}

// processTable holds the run's managed processes by key. Records of ended
// processes are kept (their status stays readable) until replaced.
type processTable struct {
	ops    sync.Mutex // serializes start, restart and stop
	mu     sync.Mutex
	procs  map[string]*managedProcess
	closed bool
}

// managedProcess is one started command; done is closed once it has been
// reaped and its record completed.
type managedProcess struct {
	rec     ProcessRecord // guarded by processTable.mu
	stopped bool          // a stop was asked: the end is "stopped"
	done    chan struct{}
}

// processDirective runs a managed-process directive; it reports false when
// command is none.
func (s *session) processDirective(command string) bool {
	name, arg, _ := strings.Cut(command, " ")
	switch name {
	case DirectiveProcessStart, DirectiveProcessRestart, DirectiveProcessStop, DirectiveProcessStatus, DirectiveProcessLogs:
	default:
		return false
	}
	a := s.conn.agent
	rec, err := a.process(name, strings.TrimSpace(arg))
	if err != nil {
		fmt.Fprintf(s.ch.Stderr(), "sandboxd-localcloud: %v\n", err)
		s.exit(1)
		s.ch.Close()
		return true
	}
	out, _ := json.Marshal(rec)
	_, _ = s.ch.Write(append(out, '\n'))
	s.exit(0)
	s.ch.Close()
	return true
}

// process applies one directive to the process table.
func (a *Agent) process(name, arg string) (ProcessRecord, error) {
	var req processRequest
	dec := json.NewDecoder(strings.NewReader(arg))
	if err := dec.Decode(&req); err != nil {
		return ProcessRecord{}, fmt.Errorf("the request is not JSON (expected {\"key\":...}): %w", err)
	}
	if err := validProcessKey(req.Key); err != nil {
		return ProcessRecord{}, err
	}
	switch name {
	case DirectiveProcessStart:
		if strings.TrimSpace(req.Command) == "" {
			return ProcessRecord{}, errors.New("the request has no command: send {\"key\",\"command\"}")
		}
		if req.TargetPort < 0 || req.TargetPort > 65535 {
			return ProcessRecord{}, fmt.Errorf("targetPort %d is not a port (1-65535)", req.TargetPort)
		}
		a.procs.ops.Lock()
		defer a.procs.ops.Unlock()
		a.logCommandLine(fmt.Sprintf("background %s: $ %s", req.Key, req.Command))
		return a.startProcess(req.Key, req.Command, req.TargetPort)
	case DirectiveProcessRestart:
		a.procs.ops.Lock()
		defer a.procs.ops.Unlock()
		prev := a.lookupProcess(req.Key)
		if prev == nil {
			return ProcessRecord{}, unknownProcess(req.Key)
		}
		a.procs.mu.Lock()
		command, port := prev.rec.Command, prev.rec.TargetPort
		a.procs.mu.Unlock()
		a.logCommandLine(fmt.Sprintf("background %s restarted", req.Key))
		return a.startProcess(req.Key, command, port)
	case DirectiveProcessStop:
		a.procs.ops.Lock()
		defer a.procs.ops.Unlock()
		p := a.lookupProcess(req.Key)
		if p == nil {
			return ProcessRecord{}, unknownProcess(req.Key)
		}
		a.stopProcess(p)
		a.logCommandLine(fmt.Sprintf("background %s stopped", req.Key))
		return a.processRecord(p), nil
	default: // status, logs: the record names the log files
		p := a.lookupProcess(req.Key)
		if p == nil {
			return ProcessRecord{}, unknownProcess(req.Key)
		}
		return a.processRecord(p), nil
	}
}

func validProcessKey(key string) error {
	if key == "" {
		return errors.New("the request has no key: name the background process")
	}
	if len(key) > processKeyLimit {
		return fmt.Errorf("the key is longer than %d bytes", processKeyLimit)
	}
	for _, c := range key {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return fmt.Errorf("key %q may contain only letters, digits, '_' and '-'", key)
		}
	}
	return nil
}

func unknownProcess(key string) error {
	return fmt.Errorf("no background process named %q: start it first", key)
}

func (a *Agent) lookupProcess(key string) *managedProcess {
	a.procs.mu.Lock()
	defer a.procs.mu.Unlock()
	return a.procs.procs[key]
}

func (a *Agent) processRecord(p *managedProcess) ProcessRecord {
	a.procs.mu.Lock()
	defer a.procs.mu.Unlock()
	return p.rec
}

// processDir is where the logs of managed processes go: a directory of
// localcloud's outside the workspace (the run's processes/, which the
// sandbox sees read-only at the same path, so that the RWX CLI's
// `background logs` can tail them there). Never in the workspace: the
// sandbox could have planted a symlink there, and this process, outside
// the sandbox, would follow it.
func (a *Agent) processDir() string {
	if a.cfg.ProcessDir != "" {
		return a.cfg.ProcessDir
	}
	return a.tempProcessDir
}

// openProcessLog creates the log at path afresh: a previous log of the
// same key is removed first (a reader following it by name sees the new
// one), and nothing that is not a new regular file is opened.
func openProcessLog(path string) (*os.File, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("remove the previous process log %s: %w", path, err)
	}
	// Readable by the sandbox's user, which is another host user when
	// localcloud runs as root; the directory is localcloud's.
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open the process log: %w", err)
	}
	return f, nil
}

// startProcess starts command under key, replacing (stopping) a process of
// the same key first.
func (a *Agent) startProcess(key, command string, port int) (ProcessRecord, error) {
	if prev := a.lookupProcess(key); prev != nil {
		a.stopProcess(prev)
	}
	dir := a.processDir()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return ProcessRecord{}, fmt.Errorf("create the process log directory %s: %w", dir, err)
	}
	stdoutPath := filepath.Join(dir, key+".stdout.log")
	stderrPath := filepath.Join(dir, key+".stderr.log")
	stdout, err := openProcessLog(stdoutPath)
	if err != nil {
		return ProcessRecord{}, err
	}
	defer stdout.Close()
	stderr, err := openProcessLog(stderrPath)
	if err != nil {
		return ProcessRecord{}, err
	}
	defer stderr.Close()

	cmd := a.command("/bin/sh", "-c", command)
	cmd.Env = a.cfg.Env
	cmd.Stdout, cmd.Stderr = stdout, stderr // files: the child writes them directly
	// Its own session (so its own process group, which stop reaches as a
	// whole), without a controlling terminal: not localcloud's.
	cmd.SysProcAttr = dieWithServer(&syscall.SysProcAttr{Setsid: true})

	a.procs.mu.Lock()
	defer a.procs.mu.Unlock()
	if a.procs.closed {
		return ProcessRecord{}, errors.New("the sandbox is ending: no new background processes")
	}
	if err := cmd.Start(); err != nil {
		return ProcessRecord{}, fmt.Errorf("start %q in %s: %w", command, a.cfg.Workspace, err)
	}
	now := time.Now().UTC()
	p := &managedProcess{
		rec: ProcessRecord{
			Key: key, Status: ProcessRunning, TargetPort: port, Command: command,
			PID: cmd.Process.Pid, PGID: cmd.Process.Pid, StartedAt: now.Format(time.RFC3339Nano),
			StdoutPath: stdoutPath, StderrPath: stderrPath,
		},
		done: make(chan struct{}),
	}
	if a.procs.procs == nil {
		a.procs.procs = make(map[string]*managedProcess)
	}
	a.procs.procs[key] = p
	a.wg.Add(1)
	go a.reap(p, cmd)
	return p.rec, nil
}

// reap waits for the process and completes its record.
func (a *Agent) reap(p *managedProcess, cmd *exec.Cmd) {
	defer a.wg.Done()
	_ = cmd.Wait()
	ws, _ := cmd.ProcessState.Sys().(syscall.WaitStatus)
	a.procs.mu.Lock()
	p.rec.CompletedAt = time.Now().UTC().Format(time.RFC3339Nano)
	p.rec.Status = ProcessExited
	if p.stopped {
		p.rec.Status = ProcessStopped
	}
	if ws.Signaled() {
		p.rec.Signal = signalName(ws.Signal())
		if p.rec.Signal == "" {
			p.rec.Signal = fmt.Sprint(int(ws.Signal()))
		}
	} else {
		code := ws.ExitStatus()
		p.rec.ExitCode = &code
	}
	a.procs.mu.Unlock()
	close(p.done)
}

// stopProcess ends p's whole process group: TERM, then KILL after the
// grace period, and KILL again once the leader is gone, for children that
// ignored TERM.
func (a *Agent) stopProcess(p *managedProcess) {
	a.procs.mu.Lock()
	pgid := p.rec.PGID
	running := p.rec.Status == ProcessRunning
	if running {
		p.stopped = true
	}
	a.procs.mu.Unlock()
	if running {
		_ = syscall.Kill(-pgid, syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(a.processGrace()):
			_ = syscall.Kill(-pgid, syscall.SIGKILL)
			<-p.done
		}
	}
	// The leader is reaped; members it left behind in its group still hold
	// the group id, so this reaches them (and nothing else).
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
}

func (a *Agent) processGrace() time.Duration {
	if a.cfg.ProcessGrace > 0 {
		return a.cfg.ProcessGrace
	}
	return 3 * time.Second
}

// stopAllProcesses ends every managed process (the run is ending) and
// refuses new ones.
func (a *Agent) stopAllProcesses() {
	a.procs.mu.Lock()
	a.procs.closed = true
	procs := make([]*managedProcess, 0, len(a.procs.procs))
	for _, p := range a.procs.procs {
		procs = append(procs, p)
	}
	a.procs.mu.Unlock()
	var wg sync.WaitGroup
	for _, p := range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a.stopProcess(p)
		}()
	}
	wg.Wait()
}

// Processes returns the records of the managed processes, by key.
func (a *Agent) Processes() []ProcessRecord {
	a.procs.mu.Lock()
	defer a.procs.mu.Unlock()
	out := make([]ProcessRecord, 0, len(a.procs.procs))
	for _, p := range a.procs.procs {
		out = append(out, p.rec)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out
}

// logCommandLine writes a line to the run log (managed processes are
// user-visible activity, not sync plumbing).
func (a *Agent) logCommandLine(line string) {
	if a.cfg.RunLog == nil {
		return
	}
	a.logMu.Lock()
	defer a.logMu.Unlock()
	fmt.Fprintf(a.cfg.RunLog, "%s %s\n", time.Now().UTC().Format(time.RFC3339), line)
}

// Package hold is the holder of durable execs (docs/durable-exec.md): it
// runs a command in the sandbox apart from the SSH channel that asked for
// it, keeps its output and exit status in files, and lets a later channel
// attach from given offsets. The daemon chooses each exec's id; the
// directory of an id is created once, which is what keeps a command from
// running twice.
package hold

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// DefaultCap bounds what is kept of each of a command's streams; past it
// the bytes are counted, not kept.
const DefaultCap = 64 << 20

// Files of an id's directory.
const (
	outFile    = "out"
	errFile    = "err"
	inFile     = "in"     // a FIFO: the command's stdin, fed by the attach; made by the keeper
	inEOFFile  = "in.eof" // the caller's stdin ended
	stateFile  = "state"
	statusFile = "status"
	// The run lock is locked (flock, exclusive) by the keeper for as
	// long as it runs: an attach waiting on it wakes the moment the
	// status is written, rather than at its next poll. It is the exec's
	// directory itself, or runFile where the directory is made in place.
	runFile = "run"
)

// keeperLockFD is where the keeper finds runFile, locked, open.
const keeperLockFD = 3

// pollEvery is how often an attach looks for new output.
const pollEvery = 10 * time.Millisecond

// ErrStarted: the id was started before; the command is not run again.
var ErrStarted = errors.New("this exec was started before: it is not run again")

// ErrRefused: the helper's server was not asked, or refused before
// running anything (Options.Server and Stream wrap such errors with it):
// the command may be started another way.
var ErrRefused = errors.New("the helper's server did not take the command")

// ErrRecordGone: the helper's server was asked to run the command and no
// record of it is left (the command can remove it): it may or may not
// have run, and it is not started again.
var ErrRecordGone = errors.New("the helper's server may have started this command and no record of it is left in the sandbox: it may or may not have run, and it was not started again")

// ErrKeeperGone: what kept the exec (the helper's server or a keeper)
// ended without its status; the output so far was delivered, the command
// is no longer followed.
var ErrKeeperGone = errors.New("what kept this exec (the helper's server or its keeper) ended without writing its status: the command's end is unknown")

// renameDir places a prepared exec directory (a variable: the tests take
// the path of a file system that cannot refuse to replace).
var renameDir = renameNoReplace

// errNoReplaceUnsupported: a rename here cannot refuse to replace.
var errNoReplaceUnsupported = errors.New("the file system cannot rename without replacing")

// ErrUnknown: no exec of that id was started here.
var ErrUnknown = errors.New("no exec of that id was started here")

// validID: 16 to 64 lowercase hex digits; a loop, not a regexp, so that
// nothing is compiled at each start of this program (one per held exec).
func validID(id string) bool {
	if len(id) < 16 || len(id) > 64 {
		return false
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// Holder keeps the execs under Root.
type Holder struct {
	Root string
	// Keeper is the argv that runs Keep in a new process (the helper's own
	// `hold keep`), to which the id is appended.
	Keeper []string
	// Cap bounds each kept stream (DefaultCap when zero).
	Cap int64
	// Env is the keeper's environment, and so the command's (this
	// process's when nil).
	Env []string
	// Dir is the keeper's working directory, and so the command's (this
	// process's when empty).
	Dir string
}

// State is what `hold state` answers.
type State struct {
	Started   bool   `json:"started"`
	PID       int    `json:"pid,omitempty"`
	OutLen    int64  `json:"out_len"`
	ErrLen    int64  `json:"err_len"`
	Ended     bool   `json:"ended"`
	ExitCode  *int   `json:"exit_code,omitempty"`
	Signal    string `json:"signal,omitempty"`
	Truncated bool   `json:"truncated,omitempty"`
}

type procState struct {
	PID     int      `json:"pid"`
	Argv    []string `json:"argv"`
	Started string   `json:"started"`
}

type status struct {
	ExitCode  int    `json:"exit_code"`
	Signal    string `json:"signal,omitempty"`
	Truncated bool   `json:"truncated,omitempty"`
}

func (h *Holder) dir(id string) (string, error) {
	if !validID(id) {
		return "", fmt.Errorf("exec id %q is not 16 to 64 lowercase hex digits", id)
	}
	return filepath.Join(h.Root, id), nil
}

// Start runs argv under id once: the first Start of an id creates its
// directory and has a keeper, in a session of its own, run the command;
// any later one returns ErrStarted and runs nothing.
func (h *Holder) Start(id string, argv []string) error {
	_, run, err := h.create(id, argv, true)
	if err != nil {
		return err
	}
	// The lock is the open file's, shared with the keeper's copy: it
	// lasts until the keeper ends, whatever this process does.
	defer run.Close()
	devnull, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer devnull.Close()
	k := exec.Command(h.Keeper[0], append(append([]string(nil), h.Keeper[1:]...), id)...)
	k.Stdin, k.Stdout, k.Stderr = devnull, devnull, devnull
	k.Env, k.Dir = h.Env, h.Dir
	// Its own session: the hang-up of the channel that started it does not
	// reach it.
	k.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	k.ExtraFiles = []*os.File{run}
	if err := k.Start(); err != nil {
		return fmt.Errorf("start the keeper: %w", err)
	}
	return k.Process.Release()
}

// create makes the directory of id, once, and returns it locked (the run
// lock, held for as long as the command runs). The directory is made
// under a name of its own, locked and renamed into place without
// replacing anything: an attach never finds it unlocked before the
// command ended, no second start of the id gets it, and the start's path
// creates one entry, not three. With record, the command is in it, for a
// keeper to read. Where a rename cannot refuse to replace, it is made in
// place with a run file as the lock, as before.
func (h *Holder) create(id string, argv []string, record bool) (string, *os.File, error) {
	if len(argv) == 0 {
		return "", nil, errors.New("no command to hold")
	}
	dir, err := h.dir(id)
	if err != nil {
		return "", nil, err
	}
	if err := os.MkdirAll(h.Root, 0o700); err != nil {
		return "", nil, fmt.Errorf("create the holder's directory: %w", err)
	}
	if _, err := os.Lstat(dir); err == nil {
		return "", nil, ErrStarted
	}
	var args []byte
	if record {
		if args, err = json.Marshal(argv); err != nil {
			return "", nil, err
		}
	}
	tmp, err := os.MkdirTemp(h.Root, id+".new-")
	if err != nil {
		return "", nil, fmt.Errorf("create the exec's directory: %w", err)
	}
	run, err := os.Open(tmp)
	if err == nil {
		err = syscall.Flock(int(run.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	}
	if err == nil && record {
		err = os.WriteFile(filepath.Join(tmp, "argv"), args, 0o600)
	}
	if err == nil {
		err = renameDir(tmp, dir)
	}
	if err == nil {
		return dir, run, nil
	}
	if run != nil {
		run.Close()
	}
	_ = os.RemoveAll(tmp)
	switch {
	case errors.Is(err, errNoReplaceUnsupported):
		return h.createInPlace(dir, args, record)
	case errors.Is(err, os.ErrExist), errors.Is(err, syscall.ENOTEMPTY):
		return "", nil, ErrStarted
	}
	return "", nil, fmt.Errorf("create the exec's directory: %w", err)
}

// createInPlace is create where the rename cannot refuse to replace: the
// directory itself is the gate, a run file in it the lock.
func (h *Holder) createInPlace(dir string, args []byte, record bool) (string, *os.File, error) {
	if err := os.Mkdir(dir, 0o700); err != nil {
		if errors.Is(err, os.ErrExist) {
			return "", nil, ErrStarted
		}
		return "", nil, fmt.Errorf("create the exec's directory: %w", err)
	}
	if record {
		if err := os.WriteFile(filepath.Join(dir, "argv"), args, 0o600); err != nil {
			return "", nil, fmt.Errorf("record the command: %w", err)
		}
	}
	run, err := lockRun(dir)
	if err != nil {
		return "", nil, err
	}
	return dir, run, nil
}

// lockRun creates the exec's run file, locked for as long as it is open.
// It is locked before it is in place: an attach never finds it unlocked
// before the command ended.
func lockRun(dir string) (*os.File, error) {
	tmp := filepath.Join(dir, runFile+".new")
	run, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("create the exec's run lock: %w", err)
	}
	if err := syscall.Flock(int(run.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		run.Close()
		return nil, fmt.Errorf("lock the exec's run lock: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, runFile)); err != nil {
		run.Close()
		return nil, fmt.Errorf("place the exec's run lock: %w", err)
	}
	return run, nil
}

// openRunLock opens what holds the exec's run lock: its run file when it
// has one (made in place), else the directory itself.
func openRunLock(dir string) (*os.File, error) {
	run, err := os.Open(filepath.Join(dir, runFile))
	if errors.Is(err, os.ErrNotExist) {
		return os.Open(dir)
	}
	return run, err
}

// Spawn is Start without a keeper: the calling process (the helper's
// server, which outlives the channel) runs argv in a session of its own,
// in workDir with env, and keeps it as the keeper would, in the same
// files. It returns once the command started (or failed to); done is
// closed once its status is written.
func (h *Holder) Spawn(id string, argv, env []string, workDir string) (done <-chan struct{}, err error) {
	return h.SpawnStream(id, argv, env, workDir, nil)
}

// SpawnStream is Spawn whose command is also streamed to the start that
// asked for it, when st is not nil (st.Serve, once the start is
// answered).
func (h *Holder) SpawnStream(id string, argv, env []string, workDir string, st *Stream) (done <-chan struct{}, err error) {
	dir, run, err := h.create(id, argv, false)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(lookPath(argv[0], env), argv[1:]...)
	cmd.Args[0] = argv[0]
	cmd.Dir, cmd.Env = workDir, env
	// A session of its own: no hang-up of the server's reaches it, and
	// its process group is what a signal goes to.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	wait, err := h.run(dir, argv, cmd, st)
	if err != nil {
		run.Close()
		return nil, err
	}
	ch := make(chan struct{})
	go func() {
		defer close(ch)
		// The lock goes with the status written, as the keeper's does.
		defer run.Close()
		_ = wait()
	}()
	return ch, nil
}

// Keep runs the command recorded for id, keeps its streams (up to Cap
// each) and writes its status; it is what the keeper process does.
func (h *Holder) Keep(id string) error {
	dir, err := h.dir(id)
	if err != nil {
		return err
	}
	// The run lock (from Start) is the keeper's alone: the command and
	// what it leaves behind must not keep it.
	syscall.CloseOnExec(keeperLockFD)
	b, err := os.ReadFile(filepath.Join(dir, "argv"))
	if err != nil {
		return err
	}
	var argv []string
	if err := json.Unmarshal(b, &argv); err != nil || len(argv) == 0 {
		return fmt.Errorf("the recorded command is unreadable: %v", err)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir, _ = os.Getwd()
	// A process group of its own: signals reach the command and what it
	// started, not the keeper that writes its status.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	wait, err := h.run(dir, argv, cmd, nil)
	if err != nil {
		return err
	}
	return wait()
}

// run starts cmd (argv) with its streams kept in dir and returns what
// waits for it and writes its status; a command that cannot start has
// status 127 at once. With st, the command is streamed too: its output
// once kept, its end as soon as it is known.
func (h *Holder) run(dir string, argv []string, cmd *exec.Cmd, st *Stream) (wait func() error, err error) {
	limit := h.Cap
	if limit <= 0 {
		limit = DefaultCap
	}
	// Created at their first byte, off the start's path: an attach takes
	// a stream not yet created for an empty one.
	out, errf := &lazyFile{path: filepath.Join(dir, outFile)}, &lazyFile{path: filepath.Join(dir, errFile)}
	closeAll := func() { out.Close(); errf.Close() }
	ow, ew := &capped{w: out, left: limit}, &capped{w: errf, left: limit}
	cmd.Stdout, cmd.Stderr = ow, ew
	var in <-chan []byte
	var inEnd, exited chan struct{}
	if st != nil {
		cmd.Stdout, cmd.Stderr = &teeWriter{w: ow, s: st, typ: frameOut}, &teeWriter{w: ew, s: st, typ: frameErr}
		in, inEnd, exited = st.in, st.inEnd, st.exited
	} else {
		exited = make(chan struct{})
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		closeAll()
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		fmt.Fprintf(cmd.Stderr, "hold: %v\n", err)
		closeAll()
		close(exited)
		s := status{ExitCode: 127}
		serr := writeJSON(filepath.Join(dir, statusFile), s)
		if st != nil {
			st.end(s)
		}
		return func() error { return serr }, nil
	}
	ps := procState{PID: cmd.Process.Pid, Argv: argv, Started: time.Now().UTC().Format(time.RFC3339Nano)}
	relayDone := make(chan struct{})
	go func() {
		defer close(relayDone)
		relayStdin(dir, stdin, exited, in, inEnd)
	}()
	// Written beside the command, not before run returns: the server
	// answers the start first (a keeper's start wrote it no sooner), and a
	// streamed end does not wait on it.
	stateDone := make(chan struct{})
	go func() {
		defer close(stateDone)
		_ = writeJSON(filepath.Join(dir, stateFile), ps)
	}()
	return func() error {
		defer closeAll()
		werr := cmd.Wait()
		close(exited)
		s := status{ExitCode: cmd.ProcessState.ExitCode(), Truncated: ow.over || ew.over}
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			s.ExitCode, s.Signal = 128+int(ws.Signal()), signalName(ws.Signal())
		}
		var exitErr *exec.ExitError
		if werr != nil && !errors.As(werr, &exitErr) {
			fmt.Fprintf(errf, "hold: %v\n", werr)
		}
		// A streamed end goes before the status file, which the run
		// lock's release still waits for; but not a signal's, whose name
		// the daemon reads in that file (`hold state`) once it has the end.
		if st != nil && s.Signal == "" {
			st.end(s)
		}
		<-relayDone
		<-stateDone
		err := writeJSON(filepath.Join(dir, statusFile), s)
		if st != nil && s.Signal != "" {
			st.end(s)
		}
		return err
	}, nil
}

// capped writes up to left bytes and drops the rest, so that the command
// never blocks on a full disk quota of its own making.
// lazyFile appends to path, creating it at the first write.
type lazyFile struct {
	path string
	f    *os.File
	err  error
}

func (l *lazyFile) Write(p []byte) (int, error) {
	if l.f == nil && l.err == nil {
		l.f, l.err = os.OpenFile(l.path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	}
	if l.err != nil {
		return 0, l.err
	}
	return l.f.Write(p)
}

func (l *lazyFile) Close() {
	if l.f != nil {
		l.f.Close()
	}
}

type capped struct {
	w    io.Writer
	left int64
	over bool
}

func (c *capped) Write(p []byte) (int, error) {
	n := int64(len(p))
	if n > c.left {
		c.over = true
		p = p[:c.left]
	}
	if len(p) > 0 {
		if _, err := c.w.Write(p); err != nil {
			c.over = true
		}
		c.left -= int64(len(p))
	}
	return int(n), nil
}

// State reports the exec of id.
func (h *Holder) State(id string) (State, error) {
	dir, err := h.dir(id)
	if err != nil {
		return State{}, err
	}
	if _, err := os.Stat(dir); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return State{}, nil
		}
		return State{}, err
	}
	s := State{Started: true, OutLen: size(filepath.Join(dir, outFile)), ErrLen: size(filepath.Join(dir, errFile))}
	var ps procState
	if readJSON(filepath.Join(dir, stateFile), &ps) == nil {
		s.PID = ps.PID
	}
	var st status
	if readJSON(filepath.Join(dir, statusFile), &st) == nil {
		s.Ended, s.ExitCode, s.Signal, s.Truncated = true, &st.ExitCode, st.Signal, st.Truncated
	}
	return s, nil
}

// Attach copies the exec's stdout from byte outOff and stderr from errOff
// until it has ended and both are drained, and returns its exit code. It
// returns when ctx ends, the command going on.
func (h *Holder) Attach(ctx context.Context, id string, outOff, errOff int64, stdout, stderr io.Writer) (int, error) {
	dir, err := h.dir(id)
	if err != nil {
		return 0, err
	}
	if _, err := os.Stat(dir); err != nil {
		return 0, ErrUnknown
	}
	// Blocks until the keeper ends (at once if it has); the process exits
	// with the attach, the goroutine with it.
	waitLock := func(run *os.File) <-chan struct{} {
		ran := make(chan struct{})
		go func() {
			defer run.Close()
			_ = syscall.Flock(int(run.Fd()), syscall.LOCK_SH)
			close(ran)
		}()
		return ran
	}
	var ran <-chan struct{}
	_, noRunFile := os.Stat(filepath.Join(dir, runFile))
	if run, err := openRunLock(dir); err == nil {
		ran = waitLock(run)
	}
	// freed: the keeper's lock was seen released, so its status, written
	// before, is there to read unless the keeper died without one.
	freed := false
	for {
		// The status first: once it exists, the streams are complete.
		var st status
		ended := readJSON(filepath.Join(dir, statusFile), &st) == nil
		if !ended && freed && noRunFile != nil {
			// A directory made in place is not locked itself: its run
			// file, placed just after it, is the lock.
			noRunFile = nil
			if run, err := waitRunFile(ctx, dir); err == nil {
				ran, freed = waitLock(run), false
				continue
			}
		}
		if !ended && freed {
			return 0, ErrKeeperGone
		}
		if outOff, err = copyFrom(filepath.Join(dir, outFile), outOff, stdout); err != nil {
			return 0, err
		}
		if errOff, err = copyFrom(filepath.Join(dir, errFile), errOff, stderr); err != nil {
			return 0, err
		}
		if ended {
			return st.ExitCode, nil
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-ran:
			ran, freed = nil, true // the status is written: the next look finds it
		case <-time.After(pollEvery):
		}
	}
}

// Forget removes what was kept of the exec of id, once it ended (its
// status written); a running or unknown one is left alone.
func (h *Holder) Forget(id string) error {
	dir, err := h.dir(id)
	if err != nil {
		return err
	}
	if _, err := os.Stat(filepath.Join(dir, statusFile)); err != nil {
		return nil
	}
	return os.RemoveAll(dir)
}

// Sweep removes what is kept of the execs that ended at least age before
// now (their status written then) and that no daemon named to forget: one
// that restarted, or never came back. Running execs, and entries that are
// not an exec's, stay.
func (h *Holder) Sweep(age time.Duration, now time.Time) (removed int, err error) {
	entries, err := os.ReadDir(h.Root)
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	for _, e := range entries {
		if !e.IsDir() || !validID(e.Name()) {
			continue
		}
		dir := filepath.Join(h.Root, e.Name())
		fi, err := os.Lstat(filepath.Join(dir, statusFile))
		if err != nil || now.Sub(fi.ModTime()) < age {
			continue
		}
		if os.RemoveAll(dir) == nil {
			removed++
		}
	}
	return removed, nil
}

// runFileWait bounds the wait for the run file of a directory made in
// place, found unlocked: its keeper places it just after the directory.
const runFileWait = 200 * time.Millisecond

// waitRunFile opens the run file of dir, waiting up to runFileWait for it.
func waitRunFile(ctx context.Context, dir string) (*os.File, error) {
	deadline := time.Now().Add(runFileWait)
	for {
		run, err := os.Open(filepath.Join(dir, runFile))
		if err == nil || !errors.Is(err, os.ErrNotExist) || time.Now().After(deadline) {
			return run, err
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(pollEvery):
		}
	}
}

// pidWait is how long a signal waits for the pid of a command whose start
// is under way.
const pidWait = 5 * time.Second

// Signal sends sig to the exec's command and its process group.
func (h *Holder) Signal(id string, sig syscall.Signal) error {
	s, err := h.State(id)
	// The command's directory comes before its pid, which is written
	// beside the command: its output can reach the caller first, and a
	// Ctrl-C at that output waits for the pid rather than being lost.
	for deadline := time.Now().Add(pidWait); err == nil && s.Started && s.PID <= 1 && !s.Ended && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
		s, err = h.State(id)
	}
	if err != nil {
		return err
	}
	if !s.Started || s.PID <= 1 {
		return ErrUnknown
	}
	if s.Ended {
		return nil
	}
	return syscall.Kill(-s.PID, sig)
}

// copyFrom writes what path holds past off to w and returns the new
// offset; a file shorter than off is an error, never a rewind.
func copyFrom(path string, off int64, w io.Writer) (int64, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		if off > 0 {
			return off, fmt.Errorf("%s is gone past offset %d", filepath.Base(path), off)
		}
		return off, nil
	}
	if err != nil {
		return off, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return off, err
	}
	if fi.Size() < off {
		return off, fmt.Errorf("%s holds %d bytes, fewer than the offset %d", filepath.Base(path), fi.Size(), off)
	}
	n, err := io.Copy(w, io.NewSectionReader(f, off, fi.Size()-off))
	return off + n, err
}

func size(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// maxJSON bounds the holder's own files when read back.
const maxJSON = 64 << 10

func readJSON(path string, v any) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxJSON+1))
	if err != nil {
		return err
	}
	if len(b) > maxJSON {
		return fmt.Errorf("%s is larger than %d bytes", filepath.Base(path), maxJSON)
	}
	return json.Unmarshal(b, v)
}

// writeJSON writes v to path by rename: a reader sees all of it or none.
func writeJSON(path string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	tmp := path + ".tmp" + strconv.Itoa(os.Getpid())
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func signalName(s syscall.Signal) string {
	names := map[syscall.Signal]string{syscall.SIGHUP: "HUP", syscall.SIGINT: "INT", syscall.SIGQUIT: "QUIT", syscall.SIGKILL: "KILL", syscall.SIGTERM: "TERM", syscall.SIGPIPE: "PIPE", syscall.SIGUSR1: "USR1", syscall.SIGUSR2: "USR2", syscall.SIGSEGV: "SEGV", syscall.SIGABRT: "ABRT"}
	if n, ok := names[s]; ok {
		return n
	}
	return "UNKNOWN"
}

// relayStdin copies to the command's stdin what the attaches write into
// the FIFO and what a streamed start sends (in), and closes it once the
// caller's stdin ended (in.eof, or inEnd) and the FIFO is drained, or the
// command exited. The FIFO is opened read-write and non-blocking: an
// attach that goes away is no end of the input, and one goroutine polls
// both the data and the end.
func relayStdin(dir string, stdin io.WriteCloser, exited <-chan struct{}, in <-chan []byte, inEnd <-chan struct{}) {
	defer stdin.Close()
	// Made here, off the start's path: a feed waits for it.
	fifo := filepath.Join(dir, inFile)
	if err := syscall.Mkfifo(fifo, 0o600); err != nil && !errors.Is(err, os.ErrExist) {
		return
	}
	fd, err := syscall.Open(fifo, syscall.O_RDWR|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		return
	}
	defer syscall.Close(fd)
	buf := make([]byte, 32<<10)
	ended := false
	for {
		n, err := syscall.Read(fd, buf)
		if n > 0 {
			if _, werr := stdin.Write(buf[:n]); werr != nil {
				return // the command closed its stdin or exited
			}
			continue
		}
		if err != nil && err != syscall.EAGAIN && err != syscall.EINTR {
			return
		}
		if ended {
			return
		}
		if _, serr := os.Stat(filepath.Join(dir, inEOFFile)); serr == nil {
			// What was fed before the end marker may have come after the
			// read above: the FIFO once more, then the end.
			ended = true
			continue
		}
		select {
		case <-exited:
			return
		case b := <-in:
			if _, werr := stdin.Write(b); werr != nil {
				return
			}
		case <-inEnd:
			// The FIFO once more, then the end.
			ended, inEnd = true, nil
		case <-time.After(pollEvery):
		}
	}
}

// Feed copies r into the exec's stdin until r ends or ctx ends; either
// way a later attach may feed more. The end of the caller's input is told
// apart (EOF): a channel that is lost also ends r.
func (h *Holder) Feed(ctx context.Context, id string, r io.Reader) error {
	dir, err := h.dir(id)
	if err != nil {
		return err
	}
	// Non-blocking: with no reader (the keeper has not opened it yet, or
	// the command ended) the open fails at once instead of waiting.
	var f *os.File
	for {
		f, err = os.OpenFile(filepath.Join(dir, inFile), os.O_WRONLY|syscall.O_NONBLOCK, 0)
		if err == nil {
			break
		}
		// ENOENT: the keeper has not made it yet.
		if !errors.Is(err, syscall.ENXIO) && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		if _, serr := os.Stat(filepath.Join(dir, statusFile)); serr == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(pollEvery):
		}
	}
	defer f.Close()
	buf := make([]byte, 32<<10)
	for {
		n, rerr := r.Read(buf)
		for b := buf[:n]; len(b) > 0; {
			w, err := f.Write(b)
			b = b[w:]
			if err != nil && !errors.Is(err, syscall.EAGAIN) {
				return err
			}
			if len(b) > 0 {
				if ctx.Err() != nil {
					return ctx.Err()
				}
				time.Sleep(pollEvery)
			}
		}
		if rerr != nil {
			if rerr == io.EOF {
				return nil
			}
			return rerr
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
}

// StdinFrames is the option of start and attach whose stdin comes in
// frames: a 4-byte big-endian length, then that many bytes; an empty frame
// is the end of the caller's input. A channel that is lost ends the bytes
// without that frame, so it is no end of the input, and no request of its
// own (`hold eof`) is needed to tell one.
const StdinFrames = "--stdin-frames"

// maxFrame bounds one stdin frame.
const maxFrame = 1 << 20

func (h *Holder) feed(ctx context.Context, id string, r io.Reader, framed bool) error {
	if framed {
		return h.FeedFrames(ctx, id, r)
	}
	return h.Feed(ctx, id, r)
}

// FeedFrames is Feed for framed input (StdinFrames): the empty frame
// ends the exec's stdin (EOF); bytes that end without it, or a frame past
// maxFrame, end this feed only.
func (h *Holder) FeedFrames(ctx context.Context, id string, r io.Reader) error {
	pr, pw := io.Pipe()
	ended := make(chan bool, 1)
	go func() {
		var hdr [4]byte
		buf := make([]byte, 32<<10)
		for {
			if _, err := io.ReadFull(r, hdr[:]); err != nil {
				pw.CloseWithError(err)
				ended <- false
				return
			}
			n := int(binary.BigEndian.Uint32(hdr[:]))
			if n == 0 {
				pw.Close()
				ended <- true
				return
			}
			if n > maxFrame {
				pw.CloseWithError(fmt.Errorf("a stdin frame of %d bytes is past the bound of %d", n, maxFrame))
				ended <- false
				return
			}
			for n > 0 {
				m, err := io.ReadFull(r, buf[:min(n, len(buf))])
				if _, werr := pw.Write(buf[:m]); werr != nil {
					ended <- false
					return
				}
				if err != nil {
					pw.CloseWithError(err)
					ended <- false
					return
				}
				n -= m
			}
		}
	}()
	err := h.Feed(ctx, id, pr)
	pr.Close()
	if err != nil {
		return err
	}
	select {
	case end := <-ended:
		if end {
			return h.EOF(id)
		}
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// EOF ends the exec's stdin once the command read what was fed before.
func (h *Holder) EOF(id string) error {
	dir, err := h.dir(id)
	if err != nil {
		return err
	}
	if _, err := os.Stat(dir); err != nil {
		return ErrUnknown
	}
	return os.WriteFile(filepath.Join(dir, inEOFFile), nil, 0o600)
}

// lookPath finds file as exec.LookPath would in a process whose
// environment is env (the caller's, not the server's).
func lookPath(file string, env []string) string {
	if strings.Contains(file, "/") {
		return file
	}
	path := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			path = v
		}
	}
	for _, d := range filepath.SplitList(path) {
		if d == "" {
			d = "."
		}
		p := filepath.Join(d, file)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p
		}
	}
	return file
}

package daemon

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// ErrAlreadyRunning is matched (errors.Is) by *AlreadyRunningError.
var ErrAlreadyRunning = errors.New("sandboxd is already running")

// AlreadyRunningError reports that another sandboxd holds the database.
// PID and Socket come from that daemon's pid file; they are zero/empty
// when it could not be read.
type AlreadyRunningError struct {
	PID      int
	Socket   string
	Database string
}

func (e *AlreadyRunningError) Error() string {
	var who []string
	if e.PID > 0 {
		who = append(who, "pid "+strconv.Itoa(e.PID))
	}
	if e.Socket != "" {
		who = append(who, "socket "+e.Socket)
	}
	if len(who) == 0 {
		who = append(who, "it holds "+e.Database)
	}
	return fmt.Sprintf("sandboxd is already running (%s); use it, or stop it with `nook daemon stop` first", strings.Join(who, ", "))
}

// Is makes errors.Is(err, ErrAlreadyRunning) true.
func (e *AlreadyRunningError) Is(target error) bool { return target == ErrAlreadyRunning }

// pidFile sits next to the database. Line 1 is the pid (as in any pid
// file), line 2 the socket the daemon serves.
func pidFile(stateDir string) string { return filepath.Join(stateDir, "sandboxd.pid") }

// writePIDFile writes the file atomically (temp file, fsync, rename), so a
// second daemon never reads half of it.
func writePIDFile(path string, pid int, socket string) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".sandboxd.pid.*")
	if err != nil {
		return fmt.Errorf("write pid file %s: %w", path, err)
	}
	defer os.Remove(tmp.Name()) // no-op after the rename
	_, err = fmt.Fprintf(tmp, "%d\n%s\n", pid, socket)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(tmp.Name(), 0o600)
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		return fmt.Errorf("write pid file %s: %w", path, err)
	}
	return nil
}

// readPIDFile returns the pid and socket of the daemon that wrote path; pid
// is 0 when the file is missing, malformed, or its process is gone.
func readPIDFile(path string) (pid int, socket string) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, ""
	}
	first, rest, _ := strings.Cut(string(b), "\n")
	pid, err = strconv.Atoi(strings.TrimSpace(first))
	if err != nil || pid <= 0 {
		return 0, ""
	}
	if syscall.Kill(pid, 0) == syscall.ESRCH {
		return 0, ""
	}
	return pid, strings.TrimSpace(rest)
}

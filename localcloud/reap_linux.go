package localcloud

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
)

// reapLeftovers kills what a previous server of this state directory left
// running: its sandbox commands carry RWX_WORKSPACE naming a workspace under
// dir/runs, and Pdeathsig ends only each command's first process, not what
// it started in the background. It runs under the state directory's lock,
// so no live server owns them; their results could never be reported.
func reapLeftovers(dir string, log *slog.Logger) int {
	marker := []byte("RWX_WORKSPACE=" + filepath.Join(dir, "runs") + string(filepath.Separator))
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	self := os.Getpid()
	n := 0
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		env, err := os.ReadFile("/proc/" + e.Name() + "/environ")
		if err != nil || !hasEnvEntry(env, marker) {
			continue
		}
		if pgid, err := syscall.Getpgid(pid); err == nil && pgid == pid {
			_ = syscall.Kill(-pgid, syscall.SIGKILL)
		}
		if syscall.Kill(pid, syscall.SIGKILL) == nil {
			n++
		}
	}
	if n > 0 {
		log.Warn("killed sandbox processes left running by a server that died", "count", n)
	}
	return n
}

// hasEnvEntry reports whether a NUL-separated environment holds an entry
// starting with prefix.
func hasEnvEntry(env, prefix []byte) bool {
	for _, kv := range bytes.Split(env, []byte{0}) {
		if bytes.HasPrefix(kv, prefix) {
			return true
		}
	}
	return false
}

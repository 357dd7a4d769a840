package e2e

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

// lockedBuffer collects a process's output for a test reading it meanwhile.
type lockedBuffer = testutil.LockedBuffer

// waitExit waits for cmd (started) to exit, failing the test (and killing
// it) when it does not within limit: the guarantee under test is that it
// never hangs.
func waitExit(t *testing.T, cmd *exec.Cmd, limit time.Duration, what string) int {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if ee, ok := err.(*exec.ExitError); ok {
			return ee.ExitCode()
		}
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		return 0
	case <-time.After(limit):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("%s: still running after %s", what, limit)
		return -1
	}
}

// connectedUnixSockets counts the connected Unix sockets of process pid.
func connectedUnixSockets(pid int) int {
	inodes := map[string]bool{}
	fds, _ := filepath.Glob("/proc/" + strconv.Itoa(pid) + "/fd/*")
	for _, fd := range fds {
		if l, err := os.Readlink(fd); err == nil && strings.HasPrefix(l, "socket:[") {
			inodes[strings.TrimSuffix(strings.TrimPrefix(l, "socket:["), "]")] = true
		}
	}
	b, _ := os.ReadFile("/proc/net/unix")
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		// Num RefCount Protocol Flags Type St Inode Path
		f := strings.Fields(line)
		if len(f) >= 7 && f[5] == "03" && inodes[f[6]] {
			n++
		}
	}
	return n
}

// TestExecNeverHangsWhenTheDaemonDies: the daemon dies (SIGKILL) after nook
// connected and sent its exec, before any answer, while nook's stdin is still
// open: nook exits 125 saying the daemon died and that the command most
// likely did not run, instead of waiting forever on its request stream.
func TestExecNeverHangsWhenTheDaemonDies(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	d := e.startDaemon()
	repo := e.newRepo("diesilent", defaultConfig)
	// A stopped daemon accepts nothing: the connection waits in the
	// listen backlog, as a request waits on a daemon busy elsewhere.
	must(t, syscall.Kill(d.cmd.Process.Pid, syscall.SIGSTOP))
	stdinR, stdinW, err := os.Pipe()
	must(t, err)
	defer stdinW.Close()
	cmd := e.nookCmd(repo, "exec", "--", "true")
	cmd.Stdin = stdinR
	var stderr lockedBuffer
	cmd.Stderr = &stderr
	must(t, cmd.Start())
	stdinR.Close()
	waitUntil(t, 30*time.Second, "nook connected to the daemon", func() bool { return connectedUnixSockets(cmd.Process.Pid) > 0 })
	d.kill()
	code := waitExit(t, cmd, 30*time.Second, "nook exec after the daemon died")
	if code != 125 || !strings.Contains(stderr.String(), "did it die") || !strings.Contains(stderr.String(), "did not run") {
		t.Fatalf("exit %d, stderr %q", code, stderr.String())
	}
}

// TestOneSignalEndsAnExecWaitingOnAFailingRemote: an exec waiting for its
// sandbox while the remote answers 503 says so within seconds (not after
// the ten-minute wait), and one SIGINT (or SIGTERM) ends it at once; the
// daemon lets go of the request, and the next exec works once the remote
// recovers.
func TestOneSignalEndsAnExecWaitingOnAFailingRemote(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	e.writeConfig(map[string]any{"reconcile_interval": "1h"})
	e.startDaemon()
	repo := e.newRepo("failing", defaultConfig)
	st := decode[startJSON](t, e.mustNook(repo, "start", "--json").stdout)
	if st.Session.Status == "ready" {
		t.Fatalf("the sandbox is ready before the test could fail the remote: %+v", st)
	}
	lc.call(t, "POST", "/admin/faults", map[string]any{"error_rate_5xx": 1.0})
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		cmd := e.nookCmd(repo, "exec", "--", "true")
		var stderr lockedBuffer
		cmd.Stderr = &stderr
		must(t, cmd.Start())
		waitUntil(t, 60*time.Second, "the exec reporting the failing remote", func() bool {
			return strings.Contains(stderr.String(), "the remote failed") && strings.Contains(stderr.String(), "503")
		})
		must(t, cmd.Process.Signal(sig))
		code := waitExit(t, cmd, 20*time.Second, "nook exec after one "+sig.String())
		if code != 130 || !strings.Contains(stderr.String(), "interrupted before the command started") {
			t.Fatalf("%v: exit %d, stderr %q", sig, code, stderr.String())
		}
		waitUntil(t, 20*time.Second, "the daemon letting go of the exec", func() bool {
			b, err := e.api("GET", "/v1/health", nil)
			var h struct {
				LiveStreams int `json:"liveStreams"`
			}
			return err == nil && json.Unmarshal(b, &h) == nil && h.LiveStreams == 0
		})
	}
	lc.call(t, "POST", "/admin/faults", map[string]any{"error_rate_5xx": 0.0})
	e.mustNook(repo, "exec", "--", "true")
}

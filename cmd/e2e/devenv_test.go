package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestCtrlCReturnsTheStatusOfACommandThatTrapsIt: a command that traps
// SIGINT and exits 7 makes sbx exit 7 after one Ctrl-C, as it would in a
// local terminal, with and without sync (the wrapping remote shells must
// not report their own death by SIGINT).
func TestCtrlCReturnsTheStatusOfACommandThatTrapsIt(t *testing.T) {
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("sigint7", defaultConfig)
	e.startSandbox(repo)
	for _, flags := range [][]string{{"--no-sync"}, nil} {
		args := append(append([]string{"exec"}, flags...), "--", "sh", "-c", `trap 'exit 7' INT; echo ready; while :; do sleep 0.05; done`)
		cmd := e.sbxCmd(repo, args...)
		var errb strings.Builder
		cmd.Stderr = &errb
		stdout, _ := cmd.StdoutPipe()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 6)
		if _, err := io.ReadFull(stdout, buf); err != nil || string(buf) != "ready\n" {
			t.Fatalf("%v: command did not start: %q %v", flags, buf, err)
		}
		_ = cmd.Process.Signal(syscall.SIGINT)
		err := cmd.Wait()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 7 {
			t.Fatalf("%v: sbx after one Ctrl-C: %v, want exit 7 (the command's own status); stderr: %s", flags, err, errb.String())
		}
	}
}

// TestMakeRunWithADaemonRunningLeavesTheLocalRemoteAlone: `make run` while
// a daemon already runs says so, and its exit trap does not stop the local
// remote it did not start: the other daemon's sandboxes, their background
// processes and their commands live on.
func TestMakeRunWithADaemonRunningLeavesTheLocalRemoteAlone(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("no make")
	}
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("makerun", defaultConfig)
	e.startSandbox(repo)
	e.mustSbx(repo, "bg", "start", "--name", "sleeper", "--", "sleep", "600")
	lcPID := localcloudPID(t, e)

	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// -o build: the test's binaries, not a build of the tree.
	cmd := exec.CommandContext(ctx, "make", "-s", "-C", root, "-o", "build", "run", "BIN="+binDir, "VERSION=test")
	cmd.Env = e.vars
	out, err := cmd.CombinedOutput()
	if err == nil || ctx.Err() != nil {
		t.Fatalf("make run with a daemon running: %v (it must fail at once)\n%s", err, out)
	}
	if !strings.Contains(string(out), "a sandboxd already runs for this user") || !strings.Contains(string(out), "left running") {
		t.Fatalf("make run must say that a daemon runs and what it left alone:\n%s", out)
	}
	if err := syscall.Kill(lcPID, 0); err != nil {
		t.Fatalf("make run stopped the local remote (pid %d) it did not start:\n%s", lcPID, out)
	}
	list := decode[bgListJSON](t, e.mustSbx(repo, "bg", "list", "--json").stdout)
	if len(list.Processes) != 1 || list.Processes[0].Status != "running" {
		t.Fatalf("the sandbox's background process must live on: %+v", list)
	}
	if r := e.mustSbx(repo, "exec", "--no-sync", "--", "echo", "alive"); r.stdout != "alive\n" {
		t.Fatalf("exec after make run: %s", r)
	}
}

// localcloudPID is the running local remote's pid, from its discovery file.
func localcloudPID(t *testing.T, e *env) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(e.get("XDG_DATA_HOME"), "sandboxd", "localcloud", "localcloud.json"))
	if err != nil {
		t.Fatalf("the local remote's discovery file: %v", err)
	}
	var d struct {
		PID int `json:"pid"`
	}
	if err := json.Unmarshal(b, &d); err != nil || d.PID <= 0 {
		t.Fatalf("the local remote's discovery file: %v %s", err, b)
	}
	return d.PID
}

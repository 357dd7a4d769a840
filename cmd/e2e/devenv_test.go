package e2e

import (
	"errors"
	"io"
	"os/exec"
	"strings"
	"syscall"
	"testing"
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

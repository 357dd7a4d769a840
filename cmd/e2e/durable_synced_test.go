package e2e

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestSyncedCommandSurvivesEightSecondsOfDroppedSilence: a synced exec
// (the framed exchange: push, command, pull) whose connection 8 s of
// silence drops goes on under the sandbox helper's holder; the daemon
// reattaches on a new connection, the caller gets all 20 lines once, in
// order, the command's own exit status and a notice of the drop, the
// command ran once, and the files it wrote in the checkout, before and
// after the silence, are on the laptop afterwards.
func TestSyncedCommandSurvivesEightSecondsOfDroppedSilence(t *testing.T) {
	t.Parallel()
	lines, every, b := 20, time.Second, longSilence
	e := newEnv(t)
	lc := e.startSilentLocalcloud(b)
	d := e.startDaemon()
	repo := e.newRepo("durablesync", defaultConfig)
	e.startServedSandbox(t, repo)
	e.mustNook(repo, "exec", "--", "true")
	counter := counterFile(t, "durablesync")
	script := fmt.Sprintf("echo ran >> %s; echo before > before.txt; i=1; while [ $i -le %d ]; do echo line $i; i=$((i+1)); sleep %s; done; echo after > after.txt; exit 7", counter, lines, fmt.Sprint(every.Seconds()))
	cmd := e.nookBackground(repo, "exec", "--", "sh", "-c", script)
	waitUntil(t, 30*time.Second, "the command to start", func() bool { return strings.Contains(readFileOr(counter), "ran") })
	time.Sleep(2 * every)
	lc.call(t, "POST", "/admin/silence", map[string]any{"duration_ms": b.silence.Milliseconds(), "drop": true})
	start := time.Now()
	r := cmd.wait(t, 2*time.Minute)
	if r.code != 7 {
		d.stop(t)
		t.Fatalf("a synced command across %v of dropped silence: %s\n%s", b.silence, r, d.logs)
	}
	var want []string
	for i := 1; i <= lines; i++ {
		want = append(want, fmt.Sprintf("line %d", i))
	}
	if got := strings.TrimSpace(r.stdout); got != strings.Join(want, "\n") {
		t.Errorf("output across the reattach:\n%s\nwant %d lines once each, in order", got, lines)
	}
	if n := strings.Count(readFileOr(counter), "ran"); n != 1 {
		t.Errorf("the command ran %d times", n)
	}
	if !strings.Contains(r.stderr, "dropped for about") || !strings.Contains(r.stderr, "is reattached") {
		t.Errorf("no notice of the drop and the reattach on stderr:\n%s", r.stderr)
	}
	for name, want := range map[string]string{"before.txt": "before\n", "after.txt": "after\n"} {
		if got, err := os.ReadFile(filepath.Join(repo, name)); err != nil || string(got) != want {
			t.Errorf("%s on the laptop after the exec: %q, %v; want %q (the pull after the reattach)", name, got, err, want)
		}
	}
	t.Logf("a synced %d-line command across %v of dropped silence: exit %d, ended %v after the silence began\n%s", lines, b.silence, r.code, time.Since(start).Round(time.Millisecond), r.stderr)
}

// TestSyncedHeldCommandStopsWhenNookDies: a synced exec's command runs
// under the holder, yet an nook that dies (no --detach) still stops it,
// as before: the daemon's TERM on the channel reaches the command.
func TestSyncedHeldCommandStopsWhenNookDies(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startLocalcloud()
	e.startDaemon()
	repo := e.newRepo("syncnodetach", defaultConfig)
	e.startServedSandbox(t, repo)
	e.mustNook(repo, "exec", "--", "true")
	counter := counterFile(t, "syncnodetach")
	cmd := e.nookBackground(repo, "exec", "--", "sh", "-c", fmt.Sprintf("echo ran >> %s; sleep 3; echo survived >> %s", counter, counter))
	waitUntil(t, 30*time.Second, "the command to start", func() bool { return strings.Contains(readFileOr(counter), "ran") })
	_ = cmd.cmd.Process.Kill()
	cmd.wait(t, 30*time.Second)
	time.Sleep(5 * time.Second)
	if got := readFileOr(counter); strings.Contains(got, "survived") {
		t.Errorf("a synced command whose nook was killed ran on:\n%s", got)
	}
}

// TestSyncedCommandGetsStdinAndSignalsAfterAReattach: after a synced
// exec's connection was dropped and the daemon reattached, the command
// reads what the caller writes to its stdin next and receives the
// caller's Ctrl-C; what it wrote in the checkout comes back.
func TestSyncedCommandGetsStdinAndSignalsAfterAReattach(t *testing.T) {
	t.Parallel()
	b := shortSilence
	e := newEnv(t)
	lc := e.startSilentLocalcloud(b)
	e.writeConfig(map[string]any{"ssh_probe_timeout": b.probeTimeout.String()})
	d := e.startDaemon()
	repo := e.newRepo("syncin", defaultConfig)
	e.startServedSandbox(t, repo)
	e.mustNook(repo, "exec", "--", "true")
	counter := counterFile(t, "syncin")
	script := fmt.Sprintf(`echo ran >> %s; trap 'echo got INT; exit 9' INT; read a; echo "got $a"; echo "$a" > got.txt; while :; do sleep 0.1; done`, counter)
	c := e.nookCmd(repo, "exec", "--", "sh", "-c", script)
	stdin, err := c.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, errb := &syncBuf{}, &syncBuf{}
	c.Stdout, c.Stderr = out, errb
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Wait() }()
	t.Cleanup(func() { _ = c.Process.Kill() })
	report := func() string { return fmt.Sprintf("stdout:\n%s\nstderr:\n%s\ndaemon:\n%s", out, errb, d.logs) }
	waitUntil(t, 30*time.Second, "the command to start", func() bool { return strings.Contains(readFileOr(counter), "ran") })
	lc.call(t, "POST", "/admin/silence", map[string]any{"duration_ms": b.silence.Milliseconds(), "drop": true})
	if !waitFor(time.Minute, func() bool { return strings.Contains(errb.String(), "dropped for about") }) {
		d.stop(t)
		t.Fatalf("no reattach within a minute of the drop\n%s", report())
	}
	if _, err := io.WriteString(stdin, "hello\n"); err != nil {
		t.Fatal(err)
	}
	if !waitFor(30*time.Second, func() bool { return strings.Contains(out.String(), "got hello") }) {
		d.stop(t)
		t.Fatalf("the synced command did not get the stdin written after the reattach\n%s", report())
	}
	if err := c.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	select {
	case err = <-done:
	case <-time.After(30 * time.Second):
		d.stop(t)
		t.Fatalf("the synced command did not end within 30 s of Ctrl-C after the reattach\n%s", report())
	}
	var ee *exec.ExitError
	if !asExit(err, &ee) || ee.ExitCode() != 9 || !strings.Contains(out.String(), "got INT") {
		t.Errorf("Ctrl-C after the reattach: %v, want exit 9 from the command's trap\n%s", err, report())
	}
	_ = stdin.Close()
	if n := strings.Count(readFileOr(counter), "ran"); n != 1 {
		t.Errorf("the command ran %d times", n)
	}
	if got, err := os.ReadFile(filepath.Join(repo, "got.txt")); err != nil || string(got) != "hello\n" {
		t.Errorf("got.txt on the laptop: %q, %v\n%s", got, err, report())
	}
}

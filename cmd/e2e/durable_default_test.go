package e2e

import (
	"bytes"
	"fmt"
	"io"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestDefaultConfigCommandSurvivesEightSecondsOfDroppedSilence: with no
// config at all, a 20-line, 20-second command whose connection is dropped
// by 8 s of silence goes on under the sandbox helper's holder; the caller
// gets every line once, in order, the command's own exit status and a
// notice of the drop, and the command ran once.
func TestDefaultConfigCommandSurvivesEightSecondsOfDroppedSilence(t *testing.T) {
	t.Parallel()
	lines, every, b := 20, time.Second, longSilence
	e := newEnv(t)
	lc := e.startSilentLocalcloud(b)
	d := e.startDaemon()
	repo := e.newRepo("durable", defaultConfig)
	e.startServedSandbox(t, repo)
	e.mustNook(repo, "exec", "--", "true")
	counter := counterFile(t, "durable")
	script := fmt.Sprintf("echo ran >> %s; i=1; while [ $i -le %d ]; do echo line $i; i=$((i+1)); sleep %s; done; exit 7", counter, lines, fmt.Sprint(every.Seconds()))
	cmd := e.nookBackground(repo, "exec", "--no-sync", "--", "sh", "-c", script)
	waitUntil(t, 30*time.Second, "the command to start", func() bool { return strings.Contains(readFileOr(counter), "ran") })
	time.Sleep(2 * every)
	lc.call(t, "POST", "/admin/silence", map[string]any{"duration_ms": b.silence.Milliseconds(), "drop": true})
	start := time.Now()
	r := cmd.wait(t, 2*time.Minute)
	if r.code != 7 {
		d.stop(t)
		t.Fatalf("the command across %v of dropped silence, default config: %s\n%s", b.silence, r, d.logs)
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
	t.Logf("a %d-line command across %v of dropped silence: exit %d, ended %v after the silence began\n%s", lines, b.silence, r.code, time.Since(start).Round(time.Millisecond), r.stderr)
}

// TestHeldCommandKilledByTermDuringTheOutageReportsTerm: a command that a
// SIGTERM ends while its connection is gone is reported after the
// reattach as ended by TERM (the signal's name, exit 143), as a live
// exec's would be, and it ran once.
func TestHeldCommandKilledByTermDuringTheOutageReportsTerm(t *testing.T) {
	t.Parallel()
	b := shortSilence
	e := newEnv(t)
	lc := e.startSilentLocalcloud(b)
	e.writeConfig(map[string]any{"ssh_probe_timeout": b.probeTimeout.String()})
	d := e.startDaemon()
	repo := e.newRepo("durableterm", defaultConfig)
	e.startServedSandbox(t, repo)
	e.mustNook(repo, "exec", "--", "true")
	counter := counterFile(t, "durableterm")
	marker := counterFile(t, "durableterm-kill")
	script := fmt.Sprintf("echo ran >> %s; echo before; while [ ! -e %s ]; do sleep 0.1; done; kill -TERM $$; sleep 5", counter, marker)
	cmd := e.nookBackground(repo, "--json", "exec", "--no-sync", "--", "sh", "-c", script)
	waitUntil(t, 30*time.Second, "the command to start", func() bool { return strings.Contains(readFileOr(counter), "ran") })
	lc.call(t, "POST", "/admin/silence", map[string]any{"duration_ms": b.silence.Milliseconds(), "drop": true})
	writeFile(t, marker, "kill\n")
	r := cmd.wait(t, 2*time.Minute)
	if r.code != 143 || !strings.Contains(r.stdout, `"signal":"TERM"`) {
		d.stop(t)
		t.Fatalf("a held command killed by TERM during the outage: want exit 143 and signal TERM in the result: %s\n%s", r, d.logs)
	}
	if !strings.Contains(r.stdout, "reattached") {
		t.Errorf("the command was not reattached (the test proves nothing): %s", r)
	}
	if n := strings.Count(readFileOr(counter), "ran"); n != 1 {
		t.Errorf("the command ran %d times", n)
	}
}

// syncBuf is a buffer a process writes while the test reads it.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestHeldCommandGetsStdinAndSignalsAfterAReattach: after its connection
// was dropped and the daemon reattached, a held command reads what the
// caller writes to its stdin next (the lost attach keeps none of it) and
// receives the caller's Ctrl-C. A terminal exec is never held, so there is
// no window size to resume.
func TestHeldCommandGetsStdinAndSignalsAfterAReattach(t *testing.T) {
	t.Parallel()
	b := shortSilence
	e := newEnv(t)
	lc := e.startSilentLocalcloud(b)
	e.writeConfig(map[string]any{"ssh_probe_timeout": b.probeTimeout.String()})
	d := e.startDaemon()
	repo := e.newRepo("durablein", defaultConfig)
	e.startServedSandbox(t, repo)
	e.mustNook(repo, "exec", "--", "true")
	counter := counterFile(t, "durablein")
	script := fmt.Sprintf(`echo ran >> %s; trap 'echo got INT; exit 9' INT; read a; echo "got $a"; while :; do sleep 0.1; done`, counter)
	c := e.nookCmd(repo, "exec", "--no-sync", "--", "sh", "-c", script)
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
		t.Fatalf("the held command did not get the stdin written after the reattach\n%s", report())
	}
	if err := c.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	select {
	case err = <-done:
	case <-time.After(30 * time.Second):
		d.stop(t)
		t.Fatalf("the held command did not end within 30 s of Ctrl-C after the reattach\n%s", report())
	}
	var ee *exec.ExitError
	if code := 0; err != nil {
		if !asExit(err, &ee) {
			t.Fatalf("nook: %v", err)
		}
		code = ee.ExitCode()
		if code != 9 || !strings.Contains(out.String(), "got INT") {
			t.Errorf("Ctrl-C after the reattach: exit %d, want 9 from the command's trap\n%s", code, report())
		}
	} else {
		t.Errorf("Ctrl-C after the reattach: exit 0, want 9\n%s", report())
	}
	_ = stdin.Close()
	if n := strings.Count(readFileOr(counter), "ran"); n != 1 {
		t.Errorf("the command ran %d times", n)
	}
}

func asExit(err error, ee **exec.ExitError) bool {
	e, ok := err.(*exec.ExitError)
	*ee = e
	return ok
}

// waitFor polls cond until it holds or timeout passes.
func waitFor(timeout time.Duration, cond func() bool) bool {
	end := time.Now().Add(timeout)
	for time.Now().Before(end) {
		if cond() {
			return true
		}
		time.Sleep(50 * time.Millisecond)
	}
	return cond()
}

// TestPlainCommandOnASilentConnectionIsProbedAndSaysSo: where the holder
// cannot run (sync_helper off), a running command whose connection goes
// silent for good is found by the daemon's probes (ssh_probe_timeout), not
// at its keepalive timeout (25 s): the exec ends with exit 125 and a
// report, having said on stderr what it waited for, and ran once.
func TestPlainCommandOnASilentConnectionIsProbedAndSaysSo(t *testing.T) {
	t.Parallel()
	b := shortSilence
	e := newEnv(t)
	lc := e.startSilentLocalcloud(b)
	e.writeConfig(map[string]any{"ssh_probe_timeout": b.probeTimeout.String(), "sync_helper": "off"})
	d := e.startDaemon()
	repo := e.newRepo("plainprobe", defaultConfig)
	e.startSandbox(repo)
	e.mustNook(repo, "exec", "--", "true")
	counter := counterFile(t, "plainprobe")
	cmd := e.nookBackground(repo, "exec", "--no-sync", "--", "sh", "-c", fmt.Sprintf("echo ran >> %s; sleep 60", counter))
	waitUntil(t, 30*time.Second, "the command to start", func() bool { return strings.Contains(readFileOr(counter), "ran") })
	lc.call(t, "POST", "/admin/silence", map[string]any{"duration_ms": 60_000, "drop": true})
	start := time.Now()
	r := cmd.wait(t, 2*time.Minute)
	took := time.Since(start)
	// A probe every 5 s, answered within the probe timeout, with margin;
	// the keepalive timeout is 25 s.
	if bound := 5*time.Second + b.probeTimeout + 5*time.Second; took > bound {
		t.Errorf("the exec on a silent connection ended %v after the silence began, past %v", took.Round(time.Millisecond), bound)
	}
	checkFailure(t, "a plain command on a silent connection", r)
	if !strings.Contains(r.stderr, "went silent: no answer to a probe") {
		d.stop(t)
		t.Errorf("nothing said what the exec waited for:\n%s\n%s", r.stderr, d.logs)
	}
	if n := strings.Count(readFileOr(counter), "ran"); n != 1 {
		t.Errorf("the command ran %d times", n)
	}
	t.Logf("a plain command on a silent connection ended %v after the silence began:\n%s", took.Round(time.Millisecond), r.stderr)
}

// TestHeldCommandOnANetworkThatStaysDownEndsAtTheReattachBound: a held
// command's network goes down for a minute (its connection and every new
// one silent); the exec does not wait the lock's bound (minutes) for a
// connection to reattach: it ends with exit 125 at reattach_timeout,
// saying which bound it reached, and nothing ran twice.
func TestHeldCommandOnANetworkThatStaysDownEndsAtTheReattachBound(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	e.writeConfig(map[string]any{"reattach_timeout": "3s", "ssh_probe_timeout": "1s"})
	e.startDaemon()
	repo := e.newRepo("outage", defaultConfig)
	e.startServedSandbox(t, repo)
	counter := counterFile(t, "outage")
	cmd := e.nookBackground(repo, "exec", "--no-sync", "--", "sh", "-c", "echo ran >> "+counter+"; sleep 90")
	waitUntil(t, 30*time.Second, "the command to start", func() bool { return strings.Contains(readFileOr(counter), "ran") })
	lc.call(t, "POST", "/admin/silence", map[string]any{"duration_ms": 60_000, "drop": true, "new": true})
	defer lc.call(t, "POST", "/admin/silence", map[string]any{"duration_ms": 0})
	start := time.Now()
	r := cmd.wait(t, 45*time.Second)
	took := time.Since(start)
	if r.code != 125 || !strings.Contains(r.stderr, "reattach_timeout") {
		t.Fatalf("a held exec whose network stays down, after %v: %s; want exit 125 naming reattach_timeout", took, r)
	}
	if n := strings.Count(readFileOr(counter), "ran"); n != 1 {
		t.Errorf("the command ran %d times", n)
	}
	t.Logf("ended after %v: %s", took.Round(time.Millisecond), strings.TrimSpace(r.stderr))
}

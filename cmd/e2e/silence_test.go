package e2e

import (
	"encoding/json"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"
)

// silenceBounds are the figures of a silence test: the agent frees a
// silent client's lock after agentKeepalive x agentKeepaliveCount; the
// daemon replaces a connection that leaves a probe unanswered for
// probeTimeout.
type silenceBounds struct {
	agentKeepalive      time.Duration
	agentKeepaliveCount int
	probeTimeout        time.Duration
	silence             time.Duration
}

// Short figures for make test; SANDBOXD_TEST_LONG uses the (8 s of
// silence, the agent's and the daemon's defaults).
var (
	shortSilence = silenceBounds{agentKeepalive: 500 * time.Millisecond, agentKeepaliveCount: 8, probeTimeout: time.Second, silence: 2 * time.Second}
	longSilence  = silenceBounds{agentKeepalive: 5 * time.Second, agentKeepaliveCount: 3, probeTimeout: 5 * time.Second, silence: 8 * time.Second}
)

const probeTimeout = time.Second

func currentSilence() silenceBounds {
	if long() {
		return longSilence
	}
	return shortSilence
}

// startSilentLocalcloud starts a local remote at 20 ms RTT whose agents
// detect silent clients as b says.
func (e *env) startSilentLocalcloud(b silenceBounds) *localcloud {
	return e.startLocalcloud("--one-way-delay", "10ms",
		"--agent-keepalive-interval", b.agentKeepalive.String(),
		"--agent-keepalive-count", fmt.Sprint(b.agentKeepaliveCount))
}

// TestExecAfterASilenceDuringTheLeaseRunsWithinTheKeepaliveBound: the
// network goes silent for good for the connections open while the daemon
// holds the sandbox's lock (a laptop's change of network right after an
// exec): the unlock is lost and the agent keeps the lock for the silent
// connection. An exec started during the silence and one started after it
// both run, once each, and the latter completes within the agent's
// keepalive timeout plus a handshake and a round trip (with margin),
// saying on stderr that it waits for the lock of this machine's connection
// that went silent; the daemon's own keepalive (10 s + 15 s) is not waited
// for.
func TestExecAfterASilenceDuringTheLeaseRunsWithinTheKeepaliveBound(t *testing.T) {
	t.Parallel()
	b := currentSilence()
	silenceFor, agentTimeout := b.silence, b.agentKeepalive*time.Duration(b.agentKeepaliveCount)
	e := newEnv(t)
	lc := e.startSilentLocalcloud(b)
	e.writeConfig(map[string]any{"ssh_probe_timeout": b.probeTimeout.String()})
	e.startDaemon()
	repo := e.newRepo("silence", defaultConfig)
	e.startSandbox(repo)
	counter := counterFile(t, "silence")
	e.mustNook(repo, "exec", "--no-sync", "--", "true")

	// Within the lease (250 ms): the lock is held by the connection that
	// goes silent.
	e.mustNook(repo, "exec", "--no-sync", "--", "true")
	silenced := time.Now()
	lc.call(t, "POST", "/admin/silence", map[string]any{"duration_ms": silenceFor.Milliseconds(), "drop": true})

	// Case 3: started during the silence, once the lease has ended (a
	// command sent within it goes out on the connection that holds the
	// lock, which went silent: it may or may not run, as any command
	// that is running when the network goes away).
	time.Sleep(500 * time.Millisecond)
	during := e.nookBackground(repo, "exec", "--no-sync", "--", "sh", "-c", "echo during >> "+counter)
	time.Sleep(time.Until(silenced.Add(silenceFor)))

	// Case 2: the first exec after the network came back.
	start := time.Now()
	after := e.nook(repo, "exec", "--no-sync", "--", "sh", "-c", "echo after >> "+counter)
	took := time.Since(start)
	rd := during.wait(t, 2*time.Minute)

	if after.code != 0 {
		t.Fatalf("the first exec after the silence: %s", after)
	}
	if rd.code != 0 {
		t.Errorf("an exec started during the silence: %s", rd)
	}
	ran := strings.Fields(readFileOr(counter))
	if strings.Count(strings.Join(ran, " "), "after") != 1 || strings.Count(strings.Join(ran, " "), "during") != 1 {
		t.Errorf("commands that ran: %q, want during and after once each", ran)
	}
	// The agent frees the lock at most agentKeepalive x count after the
	// silence began; then a handshake and a few round trips at 20 ms.
	bound := agentTimeout - silenceFor + 2*time.Second
	if took > bound {
		t.Errorf("the first exec after %v of silence took %v, want at most %v (the agent's keepalive timeout %v after the silence began, plus a handshake and a round trip, with margin)",
			silenceFor, took, bound, agentTimeout)
	}
	// A wait of over a second says what it waits for (a silence that fell
	// after the lease ended leaves no lock to wait for).
	both := after.stderr + rd.stderr
	if took > 1500*time.Millisecond && (!strings.Contains(both, "waiting for the sandbox's lock") || !strings.Contains(both, "went silent")) {
		t.Errorf("no word on stderr of what the execs waited for:\nduring: %s\nafter: %s", rd.stderr, after.stderr)
	}
	t.Logf("first exec after %v of silence (20 ms RTT, agent keepalive %v x %d, probe %v): %v", silenceFor, b.agentKeepalive, b.agentKeepaliveCount, b.probeTimeout, took.Round(time.Millisecond))
	t.Logf("stderr of the exec started during the silence:\n%s", rd.stderr)
}

// TestLockWaitEndsAtItsBoundWithAReport: against a lock that is never
// freed (another client took it and went silent, on an agent that keeps
// silent connections for ever, as RWX's may) an exec waits for the lock
// only until lock_timeout, then fails with exit 125 and a report saying
// that the command did not run, what it waited for and what to do; nothing
// ran.
func TestLockWaitEndsAtItsBoundWithAReport(t *testing.T) {
	t.Parallel()
	const lockTimeout = 2 * time.Second
	e := newEnv(t)
	lc := e.startLocalcloud("--agent-keepalive-interval", "-1s")
	e.writeConfig(map[string]any{"ssh_probe_timeout": probeTimeout.String(), "lock_timeout": lockTimeout.String()})
	e.startDaemon()
	repo := e.newRepo("lockbound", defaultConfig)
	run := e.startSandbox(repo)
	counter := counterFile(t, "lockbound")
	e.mustNook(repo, "exec", "--no-sync", "--", "true")
	time.Sleep(500 * time.Millisecond) // the daemon's lease ends

	// Another client takes the lock, then its network goes away.
	other := lc.sshTo(t, run)
	sess, err := other.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	if err := sess.Run("__rwx_sandbox_lock_requested__"); err != nil {
		t.Fatal(err)
	}
	lc.call(t, "POST", "/admin/silence", map[string]any{"duration_ms": 60_000, "drop": true})

	start := time.Now()
	r := e.nook(repo, "exec", "--no-sync", "--", "sh", "-c", "echo ran >> "+counter)
	took := time.Since(start)
	checkFailure(t, "an exec behind a lock that is never freed", r)
	if !strings.Contains(r.stderr, "waiting for the sandbox's lock since") || !strings.Contains(r.stderr, "held by another client") || !strings.Contains(r.stderr, "lock_timeout") {
		t.Errorf("the report does not say what it waited for and how it is bounded: %s", r.stderr)
	}
	if got := readFileOr(counter); got != "" {
		t.Errorf("the command ran: %q", got)
	}
	if took > lockTimeout+probeTimeout+3*time.Second {
		t.Errorf("the exec gave up after %v, want about lock_timeout %v (plus the probe of the silent connection %v)", took, lockTimeout, probeTimeout)
	}
	t.Logf("gave up after %v: %s", took.Round(time.Millisecond), strings.TrimSpace(r.stderr))
}

// TestQueueWaitSaysSinceWhenAndEndsAtItsBound: an exec behind a long
// command says on stderr that it waits in the sandbox's queue and since
// when, and gives up at queue_timeout with exit 125 and a report that the
// command did not run; the command ahead is not disturbed.
func TestQueueWaitSaysSinceWhenAndEndsAtItsBound(t *testing.T) {
	t.Parallel()
	const queueTimeout = time.Second
	e := newEnv(t)
	e.writeConfig(map[string]any{"queue_timeout": queueTimeout.String()})
	e.startDaemon()
	repo := e.newRepo("queuebound", defaultConfig)
	e.startSandbox(repo)
	counter := counterFile(t, "queuebound")
	long := e.nookBackground(repo, "exec", "--no-sync", "--", "sh", "-c", "echo long >> "+counter+"; sleep 4")
	waitUntil(t, 30*time.Second, "the long command to start", func() bool { return strings.Contains(readFileOr(counter), "long") })

	start := time.Now()
	r := e.nook(repo, "exec", "--no-sync", "--", "sh", "-c", "echo behind >> "+counter)
	took := time.Since(start)
	checkFailure(t, "an exec behind a long command", r)
	if !strings.Contains(r.stderr, "ahead in its queue) since ") || !strings.Contains(r.stderr, "queue_timeout") {
		t.Errorf("the exec did not say what it waited for, since when, and how it is bounded: %s", r.stderr)
	}
	if took > queueTimeout+3*time.Second {
		t.Errorf("the exec gave up after %v, want about queue_timeout %v", took, queueTimeout)
	}
	if rl := long.wait(t, time.Minute); rl.code != 0 {
		t.Errorf("the command ahead: %s", rl)
	}
	if got := strings.Fields(readFileOr(counter)); len(got) != 1 {
		t.Errorf("commands that ran: %q, want only the long one", got)
	}
	t.Logf("gave up after %v: %s", took.Round(time.Millisecond), strings.TrimSpace(r.stderr))
}

// agentConnections is how many SSH connections the run's agent accepted.
func (lc *localcloud) agentConnections(t testing.TB, run string) int64 {
	t.Helper()
	var st struct {
		Connections int64 `json:"connections"`
	}
	if err := json.Unmarshal(lc.call(t, "GET", "/admin/runs/"+run+"/ssh-stats", nil), &st); err != nil {
		t.Fatal(err)
	}
	return st.Connections
}

// TestDaemonThatWasStoppedReplacesSilentConnectionsAtOnce: sandboxd stopped
// (SIGSTOP, as in a laptop's sleep) while the network drops its
// connections silently; once it runs again (SIGCONT) it notices the jump
// of its clock and probes its connections at once: the silent one is
// replaced within the probe timeout, not at the keepalive timeout
// (10 s + 15 s), and the next exec runs at once.
func TestDaemonThatWasStoppedReplacesSilentConnectionsAtOnce(t *testing.T) {
	t.Parallel()
	const stopped = 4 * time.Second
	e := newEnv(t)
	lc := e.startLocalcloud("--one-way-delay", "10ms")
	e.writeConfig(map[string]any{"ssh_probe_timeout": probeTimeout.String()})
	d := e.startDaemon()
	t.Cleanup(func() { _ = d.cmd.Process.Signal(syscall.SIGCONT) })
	repo := e.newRepo("sleepwake", defaultConfig)
	run := e.startSandbox(repo)
	e.mustNook(repo, "exec", "--no-sync", "--", "true")
	time.Sleep(500 * time.Millisecond) // the lease ends: no lock held
	before := lc.agentConnections(t, run)

	lc.call(t, "POST", "/admin/silence", map[string]any{"duration_ms": stopped.Milliseconds(), "drop": true})
	if err := d.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	time.Sleep(stopped)
	if err := d.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	woke := time.Now()
	bound := probeTimeout + 3*time.Second
	deadline := time.Now().Add(bound)
	for lc.agentConnections(t, run) <= before {
		if time.Now().After(deadline) {
			d.stop(t)
			t.Fatalf("no new connection to the sandbox %v after the wake\n%s", bound, d.logs)
		}
		time.Sleep(50 * time.Millisecond)
	}
	reconnected := time.Since(woke)
	start := time.Now()
	e.mustNook(repo, "exec", "--no-sync", "--", "true")
	took := time.Since(start)
	if took > 2*time.Second {
		t.Errorf("the first exec after the wake took %v", took)
	}
	t.Logf("stopped %v with the network silent: reconnected %v after SIGCONT (probe timeout %v); first exec then took %v",
		stopped, reconnected.Round(time.Millisecond), probeTimeout, took.Round(time.Millisecond))
}

// TestCommandRunsAcrossASilenceThatHoldsItsBytes: a silence that holds
// the bytes (a short sleep: TCP resumes) shorter than the keepalive
// timeouts leaves a running command alone: every line arrives, in order,
// with the command's own exit status, and it ran once.
func TestCommandRunsAcrossASilenceThatHoldsItsBytes(t *testing.T) {
	t.Parallel()
	lines, every, silence := 6, 500*time.Millisecond, 2*time.Second
	if long() {
		lines, every, silence = 20, time.Second, 8*time.Second
	}
	e := newEnv(t)
	lc := e.startLocalcloud("--one-way-delay", "10ms")
	e.startDaemon()
	repo := e.newRepo("across", defaultConfig)
	e.startSandbox(repo)
	counter := counterFile(t, "across")
	script := fmt.Sprintf("echo ran >> %s; i=1; while [ $i -le %d ]; do echo line $i; i=$((i+1)); sleep %s; done; exit 7", counter, lines, fmt.Sprint(every.Seconds()))
	cmd := e.nookBackground(repo, "exec", "--no-sync", "--", "sh", "-c", script)
	waitUntil(t, 30*time.Second, "the command to start", func() bool { return strings.Contains(readFileOr(counter), "ran") })
	time.Sleep(every)
	lc.call(t, "POST", "/admin/silence", map[string]any{"duration_ms": silence.Milliseconds()})
	start := time.Now()
	r := cmd.wait(t, 2*time.Minute)
	if r.code != 7 {
		t.Fatalf("the command across %v of silence: %s", silence, r)
	}
	var want []string
	for i := 1; i <= lines; i++ {
		want = append(want, fmt.Sprintf("line %d", i))
	}
	if got := strings.TrimSpace(r.stdout); got != strings.Join(want, "\n") {
		t.Errorf("output across the silence:\n%s\nwant %d lines in order", got, lines)
	}
	if n := strings.Count(readFileOr(counter), "ran"); n != 1 {
		t.Errorf("the command ran %d times", n)
	}
	t.Logf("a %d-line command across %v of silence: exit %d, all lines, ended %v after the silence began", lines, silence, r.code, time.Since(start).Round(time.Millisecond))
}

// TestExecDuringANetworkOutageSaysWhatItWaitsForAndRuns: the network is
// down for a while (every connection held, new ones too): an exec started
// meanwhile finds its connection silent, says so, says that it waits for
// the handshake of a new one and since when, and runs once the network is
// back.
func TestExecDuringANetworkOutageSaysWhatItWaitsForAndRuns(t *testing.T) {
	t.Parallel()
	const outage = 3 * time.Second
	e := newEnv(t)
	lc := e.startLocalcloud("--one-way-delay", "10ms")
	e.writeConfig(map[string]any{"ssh_probe_timeout": probeTimeout.String()})
	e.startDaemon()
	repo := e.newRepo("outage", defaultConfig)
	e.startSandbox(repo)
	counter := counterFile(t, "outage")
	e.mustNook(repo, "exec", "--no-sync", "--", "true")
	time.Sleep(500 * time.Millisecond) // the lease ends: no lock held

	lc.call(t, "POST", "/admin/silence", map[string]any{"duration_ms": outage.Milliseconds(), "new": true})
	start := time.Now()
	r := e.nook(repo, "exec", "--no-sync", "--", "sh", "-c", "echo ran >> "+counter)
	took := time.Since(start)
	if r.code != 0 {
		t.Fatalf("an exec during an outage of %v: %s", outage, r)
	}
	if n := strings.Count(readFileOr(counter), "ran"); n != 1 {
		t.Errorf("the command ran %d times", n)
	}
	// The silent connection is found by the lock wait's probe, or first
	// by the daemon's wake watcher when a loaded machine makes a tick late:
	// either way the user is told what the exec waits for.
	if !strings.Contains(r.stderr, "the connection to the sandbox went silent") && !strings.Contains(r.stderr, "the connection has not answered a probe yet") {
		t.Errorf("stderr does not say that the connection is silent:\n%s", r.stderr)
	}
	if !strings.Contains(r.stderr, "connecting to the sandbox since") {
		t.Errorf("stderr does not say it waits for the handshake:\n%s", r.stderr)
	}
	if took > outage+3*time.Second {
		t.Errorf("the exec took %v after an outage of %v", took, outage)
	}
	t.Logf("exec during an outage of %v: %v\n%s", outage, took.Round(time.Millisecond), r.stderr)
}

// waitHelper waits until the daemon knows the sandbox helper serves in
// run's sandbox (a held exec needs it): its server's socket comes a
// round trip before the daemon hears of it, so doctor is asked.
// startServedSandbox starts repo's sandbox, syncs it once and waits until
// the sandbox helper serves there (the held and native paths need it);
// it returns the run id.
func (e *env) startServedSandbox(t *testing.T, repo string) string {
	t.Helper()
	run := e.startSandbox(repo)
	e.mustNook(repo, "exec", "--", "true")
	e.waitHelper(t, run)
	return run
}

func (e *env) waitHelper(t *testing.T, run string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !e.helperServing(run) {
		if time.Now().After(deadline) {
			t.Fatalf("the sandbox helper of %s did not serve within a minute; doctor says:\n%s", run, e.nook(e.root, "doctor"))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestHeldCommandSurvivesASilenceThatDropsItsConnection: a command running
// when the network changes under it (its connection silent for good) goes
// on in the sandbox under the helper's holder; the daemon finds the
// connection dead, takes the lock on a new one and reattaches: every line
// arrives once, in order, with the command's own exit status, a notice
// says the connection dropped, and the command ran once.
func TestHeldCommandSurvivesASilenceThatDropsItsConnection(t *testing.T) {
	t.Parallel()
	lines, every, silence := 8, 500*time.Millisecond, 2*time.Second
	if long() {
		lines, every, silence = 20, time.Second, 8*time.Second
	}
	b := currentSilence()
	e := newEnv(t)
	lc := e.startSilentLocalcloud(b)
	e.writeConfig(map[string]any{"ssh_probe_timeout": b.probeTimeout.String(), "durable_exec": true})
	d := e.startDaemon()
	repo := e.newRepo("held", defaultConfig)
	e.startServedSandbox(t, repo)
	e.mustNook(repo, "exec", "--", "true")
	counter := counterFile(t, "held")
	script := fmt.Sprintf("echo ran >> %s; i=1; while [ $i -le %d ]; do echo line $i; i=$((i+1)); sleep %s; done; exit 7", counter, lines, fmt.Sprint(every.Seconds()))
	cmd := e.nookBackground(repo, "exec", "--no-sync", "--", "sh", "-c", script)
	waitUntil(t, 30*time.Second, "the command to start", func() bool { return strings.Contains(readFileOr(counter), "ran") })
	time.Sleep(every)
	lc.call(t, "POST", "/admin/silence", map[string]any{"duration_ms": silence.Milliseconds(), "drop": true})
	start := time.Now()
	r := cmd.wait(t, 2*time.Minute)
	if r.code != 7 {
		d.stop(t)
		t.Fatalf("the command across %v of silence that dropped its connection: %s\n%s", silence, r, d.logs)
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
	if !strings.Contains(r.stderr, "is reattached") {
		t.Errorf("no notice of the reattach on stderr:\n%s", r.stderr)
	}
	t.Logf("a %d-line command across %v of silence that dropped its connection: exit %d, ended %v after the silence began\n%s", lines, silence, r.code, time.Since(start).Round(time.Millisecond), r.stderr)
}

package e2e

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// localcloud is a sandboxd-localcloud the test started itself (so it can
// choose its timeouts and inject faults); the daemon finds it through its
// discovery file.
type localcloud struct {
	apiURL string
	token  string
	client *http.Client
}

func (e *env) startLocalcloud(args ...string) *localcloud {
	e.t.Helper()
	cmd := exec.Command(filepath.Join(binDir, "sandboxd-localcloud"), append([]string{"serve", "--enable-fault-injection"}, args...)...)
	cmd.Env = e.vars
	logs := &bytes.Buffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	e.t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
		}
	})
	var d struct {
		APIURL    string `json:"api_url"`
		CertFile  string `json:"cert_file"`
		TokenFile string `json:"token_file"`
	}
	waitUntil(e.t, 15*time.Second, "localcloud status", func() bool {
		st := exec.Command(filepath.Join(binDir, "sandboxd-localcloud"), "status", "--json")
		st.Env = e.vars
		out, err := st.Output()
		return err == nil && json.Unmarshal(out, &d) == nil && d.APIURL != ""
	})
	pem, err := os.ReadFile(d.CertFile)
	if err != nil {
		e.t.Fatal(err)
	}
	tok, err := os.ReadFile(d.TokenFile)
	if err != nil {
		e.t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pem)
	return &localcloud{apiURL: d.APIURL, token: strings.TrimSpace(string(tok)), client: &http.Client{
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}, Timeout: 30 * time.Second,
	}}
}

// call sends an authenticated request to the local remote.
func (lc *localcloud) call(t testing.TB, method, path string, body any) []byte {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, _ := http.NewRequest(method, lc.apiURL+path, rd)
	req.Header.Set("Authorization", "Bearer "+lc.token)
	req.Header.Set("Content-Type", "application/json")
	resp, err := lc.client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode/100 != 2 {
		t.Fatalf("%s %s: %d %s", method, path, resp.StatusCode, b)
	}
	return b
}

// writeConfig writes sandboxd's config file.
func (e *env) writeConfig(cfg map[string]any) {
	e.t.Helper()
	b, _ := json.Marshal(cfg)
	writeFile(e.t, filepath.Join(e.get("XDG_CONFIG_HOME"), "sandboxd", "config.json"), string(b))
}

type healthJSON struct {
	SSHHandshakes uint64 `json:"sshHandshakes"`
	Connections   int    `json:"connections"`
}

func (e *env) health() healthJSON {
	e.t.Helper()
	b, err := e.api("GET", "/v1/health", nil)
	if err != nil {
		e.t.Fatal(err)
	}
	var h healthJSON
	if err := json.Unmarshal(b, &h); err != nil {
		e.t.Fatal(err)
	}
	return h
}

// TestRestartReconnectsWithoutClients: SIGKILL of the daemon with three
// live sandboxes; after the restart all three are reconnected before any
// client asks, and the first exec makes no new SSH handshake.
func TestRestartReconnectsWithoutClients(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	d := e.startDaemon()
	var repos []string
	runs := map[string]bool{}
	for i := range 3 {
		repo := e.newRepo(fmt.Sprintf("live%d", i), defaultConfig)
		repos = append(repos, repo)
		runs[e.startSandbox(repo)] = true
	}
	d.kill()
	e.startDaemon()
	evs := e.followEvents("0")
	up := map[string]bool{}
	for len(up) < 3 {
		ev := evs.waitFor(t, 30*time.Second, "connection.up", eventType("connection.up"))
		if id, _ := ev["runId"].(string); runs[id] {
			up[id] = true
		}
	}
	before := e.health().SSHHandshakes
	for _, repo := range repos {
		e.mustNook(repo, "exec", "--no-sync", "--", "true")
	}
	if after := e.health().SSHHandshakes; after != before {
		t.Fatalf("execs after restart made %d new SSH handshakes", after-before)
	}
}

// TestReconcileLoopAdoptsAndExpires: the loop adopts a run only the remote
// knows, without any client call, and marks a run ended on the remote
// expired within one interval, closing its connection.
func TestReconcileLoopAdoptsAndExpires(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	e.writeConfig(map[string]any{"reconcile_interval": "1s"})
	d := e.startDaemon()
	repo := e.newRepo("loop", defaultConfig)
	run := e.startSandbox(repo)
	d.stop(t)
	os.Remove(filepath.Join(e.get("XDG_STATE_HOME"), "sandboxd", "sandboxd.db"))
	e.startDaemon()
	evs := e.followEvents("0")
	evs.waitFor(t, 20*time.Second, "session.adopted of "+run, func(ev map[string]any) bool {
		return ev["type"] == "session.adopted" && ev["runId"] == run
	})
	evs.waitFor(t, 20*time.Second, "connection.up of "+run, func(ev map[string]any) bool {
		return ev["type"] == "connection.up" && ev["runId"] == run
	})
	// End the run behind the daemon's back.
	lc.call(t, "POST", "/mint/api/runs/"+run+"/cancel", nil)
	evs.waitFor(t, 20*time.Second, "session.expired", func(ev map[string]any) bool {
		return ev["type"] == "session.expired" && ev["runId"] == run
	})
	waitUntil(t, 10*time.Second, "the connection to close", func() bool { return e.health().Connections == 0 })
}

// TestTransientRemoteErrorsPruneNothing: with every API call failing with a
// 5xx, reconcile passes leave the sessions in place.
func TestTransientRemoteErrorsPruneNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	e.writeConfig(map[string]any{"reconcile_interval": "1s"})
	e.startDaemon()
	repo := e.newRepo("fivexx", defaultConfig)
	run := e.startSandbox(repo)
	evs := e.followEvents("")
	lc.call(t, "POST", "/admin/faults", map[string]any{"error_rate_5xx": 1.0})
	for range 2 {
		evs.waitFor(t, 20*time.Second, "reconcile.finished", eventType("reconcile.finished"))
	}
	lc.call(t, "POST", "/admin/faults", map[string]any{"error_rate_5xx": 0.0})
	lj := decode[listJSON](t, e.mustNook(repo, "list", "--json").stdout)
	if len(lj.Sessions) != 1 || lj.Sessions[0].RunID != run {
		t.Fatalf("a transient error pruned the session: %+v", lj)
	}
	e.mustNook(repo, "exec", "--no-sync", "--", "true")

	// The sandbox's SSH connections drop and new ones are refused: the
	// daemon keeps the session (the remote still says the run is alive)
	// and reconnects once the agent answers again.
	lc.call(t, "POST", "/admin/faults", map[string]any{"drop_ssh": true})
	lc.call(t, "POST", "/admin/runs/"+run+"/drop-connections", nil)
	evs.waitFor(t, 20*time.Second, "connection.down", func(ev map[string]any) bool {
		return ev["type"] == "connection.down" && ev["runId"] == run
	})
	for range 2 {
		evs.waitFor(t, 20*time.Second, "reconcile.finished", eventType("reconcile.finished"))
	}
	lc.call(t, "POST", "/admin/faults", map[string]any{"drop_ssh": false})
	lj = decode[listJSON](t, e.mustNook(repo, "list", "--json").stdout)
	if len(lj.Sessions) != 1 || lj.Sessions[0].RunID != run || lj.Sessions[0].Status == "expired" {
		t.Fatalf("a dropped connection pruned the session: %+v", lj)
	}
	e.mustNook(repo, "exec", "--no-sync", "--", "true")
}

// TestConnectionKilledBetweenExecs: the SSH connection dies between two
// execs; the second still succeeds and the first is not run again.
func TestConnectionKilledBetweenExecs(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	e.startDaemon()
	repo := e.newRepo("drop", defaultConfig)
	run := e.startSandbox(repo)
	marker := counterFile(t, "drop")
	e.mustNook(repo, "exec", "--no-sync", "--", "sh", "-c", "echo first >> "+marker)
	lc.call(t, "POST", "/admin/runs/"+run+"/drop-connections", nil)
	e.mustNook(repo, "exec", "--no-sync", "--", "sh", "-c", "echo second >> "+marker)
	if got := readFile(t, marker); got != "first\nsecond\n" {
		t.Fatalf("commands ran as %q", got)
	}
}

// TestBranchChangeNeedsNoGit: switching branches is noticed through the
// watched HEAD; the exec hot path runs no git subprocess (a git shim on the
// daemon's PATH counts every call).
func TestBranchChangeNeedsNoGit(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	shimDir := filepath.Join(e.root, "shim")
	gitLog := filepath.Join(e.root, "git-calls")
	realGit, err := exec.LookPath("git")
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(shimDir, "git"), "#!/bin/sh\necho \"$@\" >> "+gitLog+"\nexec "+realGit+" \"$@\"\n")
	os.Chmod(filepath.Join(shimDir, "git"), 0o755)
	e.startDaemon("PATH=" + shimDir + ":" + e.get("PATH"))
	repo := e.newRepo("branches", defaultConfig)
	mainRun := decode[execJSON](t, e.mustNook(repo, "exec", "--no-sync", "--json", "--", "true").stdout).RunID
	e.git(repo, "checkout", "-q", "-b", "other")
	otherRun := decode[execJSON](t, e.mustNook(repo, "exec", "--no-sync", "--json", "--", "true").stdout).RunID
	if otherRun == mainRun {
		t.Fatal("the new branch must get its own sandbox")
	}
	os.Remove(gitLog)
	for _, c := range []struct{ branch, run string }{{"main", mainRun}, {"other", otherRun}, {"main", mainRun}} {
		e.git(repo, "checkout", "-q", c.branch)
		got := ""
		waitUntil(t, 10*time.Second, "the branch switch to "+c.branch+" to be noticed", func() bool {
			got = decode[execJSON](t, e.mustNook(repo, "exec", "--no-sync", "--json", "--", "true").stdout).RunID
			return got == c.run
		})
	}
	if b, err := os.ReadFile(gitLog); err == nil && len(b) > 0 {
		t.Fatalf("the daemon ran git on the hot path:\n%s", b)
	}
}

// TestConfigDriftEmitsOneEvent: editing .rwx/sandbox.yml emits exactly one
// drift event, and exec warns.
func TestConfigDriftEmitsOneEvent(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("drift", defaultConfig)
	run := e.startSandbox(repo)
	evs := e.followEvents("")
	writeFile(t, filepath.Join(repo, ".rwx", "sandbox.yml"), defaultConfig+"# edited\n")
	evs.waitFor(t, 10*time.Second, "config.drift", func(ev map[string]any) bool {
		return ev["type"] == "config.drift" && ev["runId"] == run
	})
	r := e.mustNook(repo, "exec", "--no-sync", "--", "true")
	if !strings.Contains(r.stderr, "nook reset") {
		t.Fatalf("exec did not warn about drift: %s", r)
	}
	// The exec's own events arrive; no second drift event among them.
	for {
		ev := evs.waitFor(t, 10*time.Second, "exec.finished", func(map[string]any) bool { return true })
		if ev["type"] == "config.drift" {
			t.Fatal("a second drift event for one edit")
		}
		if ev["type"] == "exec.finished" {
			break
		}
	}
}

// TestSlowEventsConsumerIsCutOff: an events client that stops reading is
// disconnected while execs keep working.
func TestSlowEventsConsumerIsCutOff(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("slowev", defaultConfig)
	e.startSandbox(repo)
	conn, err := net.Dial("unix", e.socket())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.(*net.UnixConn).SetReadBuffer(1024)
	fmt.Fprintf(conn, "GET /v1/events HTTP/1.1\r\nHost: sandboxd\r\n\r\n")
	// Never read: flood with events until the daemon gives up on us.
	// Never read while the daemon publishes far more events than the
	// socket and the subscriber buffer hold; the daemon must not block.
	hc := e.httpClient()
	for range 2500 {
		req, _ := http.NewRequest("POST", "http://sandboxd/v1/reconcile", nil)
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	e.mustNook(repo, "exec", "--no-sync", "--", "true")
	// Reading again drains what was queued, then the final event, then the
	// end of the stream: the chunked body ends (the connection itself may
	// stay open for keep-alive, so reading to the connection's end would
	// prove nothing).
	conn.SetReadDeadline(time.Now().Add(20 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("read the event stream's response: %v", err)
	}
	rest, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("the event stream did not end after the slow-consumer event (%d bytes read): %v", len(rest), err)
	}
	if !strings.Contains(string(rest), "slow consumer") {
		t.Fatalf("the stream did not end with a slow-consumer event (%d bytes read)", len(rest))
	}
	if n := strings.Count(string(rest), `"stream.closed"`); n != 1 {
		t.Fatalf("%d stream.closed events, want exactly one", n)
	}
}

// TestClientCreateDuringRehydrationSurvives: a session a client creates
// while the restarted daemon is still re-checking the stored ones (the
// remote slowed down on purpose) is kept, and so are the stored ones.
func TestClientCreateDuringRehydrationSurvives(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	d := e.startDaemon()
	old := map[string]string{}
	for i := range 2 {
		repo := e.newRepo(fmt.Sprintf("stored%d", i), defaultConfig)
		old[repo] = e.startSandbox(repo)
	}
	fresh := e.newRepo("fresh", defaultConfig)
	d.kill()
	lc.call(t, "POST", "/admin/faults", map[string]any{"latency_ms": 700})
	e.startDaemon()
	// The daemon answers at once, before its checks of the remote are done.
	st := decode[startJSON](t, e.mustNook(fresh, "start", "--json").stdout)
	lc.call(t, "POST", "/admin/faults", map[string]any{"latency_ms": 0})
	lj := decode[listJSON](t, e.mustNook(fresh, "list", "--json").stdout)
	got := map[string]string{}
	for _, s := range lj.Sessions {
		got[s.RepoRoot] = s.RunID
	}
	for repo, run := range old {
		if got[repo] != run {
			t.Errorf("stored session of %s: got run %q, want %q", repo, got[repo], run)
		}
	}
	if got[fresh] != st.Session.RunID {
		t.Errorf("session created during rehydration: got %q, want %q", got[fresh], st.Session.RunID)
	}
}

// TestLocalRemoteRestartKeepsSandboxes: the local remote dies (SIGKILL);
// the next exec starts it again, its sandboxes come back with their keys,
// and the daemon follows the agent to its new address.
func TestLocalRemoteRestartKeepsSandboxes(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("lcrestart", defaultConfig)
	run := e.startSandbox(repo)
	e.mustNook(repo, "exec", "--no-sync", "--", "true")
	discovery := filepath.Join(e.get("XDG_DATA_HOME"), "sandboxd", "localcloud", "localcloud.json")
	var d struct {
		PID int `json:"pid"`
	}
	if err := json.Unmarshal([]byte(readFile(t, discovery)), &d); err != nil || d.PID == 0 {
		t.Fatalf("discovery file: %v", err)
	}
	if err := syscall.Kill(d.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 10*time.Second, "the local remote to die", func() bool { return syscall.Kill(d.PID, 0) != nil })
	ej := decode[execJSON](t, e.mustNook(repo, "exec", "--no-sync", "--json", "--", "true").stdout)
	if ej.RunID != run {
		t.Fatalf("after the remote restarted, exec used run %s, want %s", ej.RunID, run)
	}
	// No run URL is shown for the local remote (its API's needs the
	// token), after a reconcile with the restarted remote too.
	var d2 struct {
		APIURL string `json:"api_url"`
	}
	if err := json.Unmarshal([]byte(readFile(t, discovery)), &d2); err != nil || d2.APIURL == "" {
		t.Fatalf("discovery file after the restart: %v", err)
	}
	if _, err := e.api("POST", "/v1/reconcile", nil); err != nil {
		t.Fatal(err)
	}
	var lj struct {
		Sessions []struct {
			RunID  string `json:"runId"`
			RunURL string `json:"runUrl"`
		} `json:"sessions"`
	}
	if err := json.Unmarshal([]byte(e.mustNook(repo, "list", "--json").stdout), &lj); err != nil || len(lj.Sessions) != 1 {
		t.Fatalf("list: %v %+v", err, lj)
	}
	if lj.Sessions[0].RunURL != "" {
		t.Fatalf("run URL %s of the local remote after it restarted (%s), want none", lj.Sessions[0].RunURL, d2.APIURL)
	}
}

package e2e

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// crashEnv is one crash case: a daemon, the local remote it uses, one
// checkout with a ready sandbox, and what must hold after the crash.
type crashEnv struct {
	*env
	t       *testing.T
	lc      *localcloud // started by the test, so its fault routes exist
	d       *daemon
	repo    string
	run     string
	counter string
	marker  string // a unique argument of the command's process
	tree    map[string]string
}

func newCrashEnv(t *testing.T, name string) *crashEnv {
	e := newEnv(t)
	c := &crashEnv{env: e, t: t}
	c.lc = e.startLocalcloud()
	c.d = e.startDaemon()
	c.repo = e.newRepo(name, defaultConfig)
	writeFile(t, filepath.Join(c.repo, "work.txt"), "uncommitted work\n")
	c.run = e.startSandbox(c.repo)
	e.mustNook(c.repo, "exec", "--", "true") // warm, and the work is synced
	c.counter = counterFile(t, name)
	c.marker = fmt.Sprintf("%d.%06d", 700+os.Getpid()%200, time.Now().UnixNano()%1000000)
	c.tree = treeSnapshot(t, c.repo)
	return c
}

// command is what a crashed exec runs: it counts itself, then sleeps under
// a unique argument so that its process can be found.
func (c *crashEnv) command() []string {
	return []string{"sh", "-c", "echo ran >> " + c.counter + "; exec sleep " + c.marker}
}

func (c *crashEnv) waitCommandStarted() {
	c.t.Helper()
	waitUntil(c.t, 30*time.Second, "the command to start", func() bool { return lines(c.t, c.counter) == 1 })
}

// lcRuns lists the runs the local remote has in progress, with the
// repository their cli_state names.
func (c *crashEnv) lcRuns() map[string]string {
	c.t.Helper()
	cmd := exec.Command(filepath.Join(binDir, "sandboxd-localcloud"), "status", "--json")
	cmd.Env = c.vars
	out, err := cmd.Output()
	if err != nil {
		c.t.Fatalf("localcloud status: %v", err)
	}
	var d struct {
		APIURL    string `json:"api_url"`
		CertFile  string `json:"cert_file"`
		TokenFile string `json:"token_file"`
	}
	if err := json.Unmarshal(out, &d); err != nil {
		c.t.Fatal(err)
	}
	lc := connectLocalcloud(c.t, d.APIURL, d.CertFile, d.TokenFile)
	var list struct {
		Runs []struct {
			ID       string `json:"id"`
			CLIState string `json:"cli_state"`
		} `json:"runs"`
	}
	if err := json.Unmarshal(lc.call(c.t, "GET", "/mint/api/runs?result_status=sandboxed&execution_status=in_progress&my_runs=true", nil), &list); err != nil {
		c.t.Fatal(err)
	}
	runs := map[string]string{}
	for _, r := range list.Runs {
		var cs struct {
			RepoRoot string `json:"repoRoot"`
		}
		b, _ := base64.StdEncoding.DecodeString(r.CLIState)
		json.Unmarshal(b, &cs)
		runs[r.ID] = cs.RepoRoot
	}
	return runs
}

// checkAfterCrash checks what must hold once the crashed pieces are back:
// the clients ended (none waits forever), at most one run of the checkout
// and none without a session after one reconcile, the command ran at most
// once and its process is gone, the agent lock is free and the next exec
// works, and the working tree is byte for byte what it was.
func (c *crashEnv) checkAfterCrash(clients ...*bgNook) {
	t := c.t
	t.Helper()
	for _, b := range clients {
		r := b.wait(t, 60*time.Second)
		if r.code == 0 {
			t.Errorf("an exec cut by the crash reported success: %s", r)
		} else if r.code > 0 {
			checkFailure(t, "exec cut by the crash", r)
		}
	}
	if _, err := c.api("POST", "/v1/reconcile", nil); err != nil {
		t.Fatalf("reconcile after the crash: %v", err)
	}
	lj := decode[listJSON](t, c.mustNook(c.repo, "list", "--json").stdout)
	sessions := map[string]bool{}
	for _, s := range lj.Sessions {
		sessions[s.RunID] = true
	}
	mine := 0
	for id, repo := range c.lcRuns() {
		if repo == c.repo {
			mine++
		}
		if !sessions[id] {
			t.Errorf("run %s (of %q) has no session after a reconcile", id, repo)
		}
	}
	if mine > 1 {
		t.Errorf("%d runs for one checkout", mine)
	}
	if n := lines(t, c.counter); n > 1 {
		t.Errorf("the command ran %d times", n)
	}
	waitUntil(t, 30*time.Second, "the crashed command's process to end", func() bool { return !processWithArg(c.marker) })
	// The lock is free and the sandbox usable: the next exec (synced)
	// completes within the bound.
	b := c.nookBackground(c.repo, "exec", "--", "true")
	if r := b.wait(t, 90*time.Second); r.code != 0 {
		t.Fatalf("the next exec after the crash: %s", r)
	}
	if got := treeSnapshot(t, c.repo); !maps.Equal(got, c.tree) {
		t.Errorf("the working tree changed:\nbefore %q\nafter  %q", c.tree, got)
	}
}

// newStartCrashEnv is a crash case during a start: a checkout whose sandbox
// takes a few seconds to provision, with no sandbox yet.
func newStartCrashEnv(t *testing.T, name string) *crashEnv {
	e := newEnv(t)
	c := &crashEnv{env: e, t: t}
	c.lc = e.startLocalcloud()
	c.d = e.startDaemon()
	c.repo = e.newRepo(name, "tasks:\n  - key: setup\n    run: sleep 4\n  - key: sandbox\n    use: setup\n    run: rwx-sandbox\n")
	writeFile(t, filepath.Join(c.repo, "work.txt"), "uncommitted work\n")
	c.counter = counterFile(t, name)
	c.marker = "no-such-process-" + name
	c.tree = treeSnapshot(t, c.repo)
	return c
}

// crashCase runs one case of the matrix; make test runs the short ones,
// make test-long all.
func crashCase(t *testing.T, name string, short bool, fn func(t *testing.T)) {
	t.Run(name, func(t *testing.T) {
		if !short && !long() {
			t.Skip("long form only (make test-long)")
		}
		// Each case has its own user, daemon and local remote.
		t.Parallel()
		fn(t)
	})
}

// TestCrashMatrix: real processes killed with SIGKILL at each phase they
// can be caught in from outside; after each, checkAfterCrash holds.
func TestCrashMatrix(t *testing.T) {
	t.Parallel()
	crashCase(t, "sandboxd-start-request-in-flight", false, func(t *testing.T) {
		c := newStartCrashEnv(t, "dkillreq")
		lc := c.lc
		// The API holds every request for 3s: the create is on its way
		// (or about to be) when the daemon dies.
		lc.call(t, "POST", "/admin/faults", map[string]any{"latency_ms": 3000})
		b := c.nookBackground(c.repo, "start", "--wait")
		time.Sleep(time.Second)
		c.d.kill()
		lc.call(t, "POST", "/admin/faults", map[string]any{"latency_ms": 0})
		r := b.wait(t, 30*time.Second)
		if r.code == 0 {
			t.Fatalf("start reported success although the daemon died: %s", r)
		}
		c.startDaemon()
		c.checkAfterCrash()
	})
	crashCase(t, "sandboxd-start-waiting-for-sandboxable", false, func(t *testing.T) {
		c := newStartCrashEnv(t, "dkillwait")
		evs := c.followEvents("")
		b := c.nookBackground(c.repo, "start", "--wait")
		// The run id is persisted (session.created), the sandbox still
		// provisions.
		evs.waitFor(t, 30*time.Second, "session.created", eventType("session.created"))
		c.d.kill()
		r := b.wait(t, 30*time.Second)
		if r.code == 0 {
			t.Fatalf("start reported success although the daemon died: %s", r)
		}
		c.startDaemon()
		c.checkAfterCrash()
	})
	crashCase(t, "nook-mid-exec", false, func(t *testing.T) {
		c := newCrashEnv(t, "nookkill")
		b := c.nookBackground(c.repo, append([]string{"exec", "--"}, c.command()...)...)
		c.waitCommandStarted()
		b.cmd.Process.Signal(syscall.SIGKILL)
		b.wait(t, 10*time.Second)
		c.checkAfterCrash()
	})
	crashCase(t, "sandboxd-mid-command", true, func(t *testing.T) {
		c := newCrashEnv(t, "dkillcmd")
		b := c.nookBackground(c.repo, append([]string{"exec", "--"}, c.command()...)...)
		c.waitCommandStarted()
		c.d.kill()
		r := b.wait(t, 30*time.Second)
		c.startDaemon()
		c.checkAfterCrashResult(r)
	})
	crashCase(t, "sandboxd-exec-queued", false, func(t *testing.T) {
		c := newCrashEnv(t, "dkillq")
		first := c.nookBackground(c.repo, append([]string{"exec", "--"}, c.command()...)...)
		c.waitCommandStarted()
		evs := c.followEvents("")
		queued := c.nookBackground(c.repo, "exec", "--", "sh", "-c", "echo queued-ran >> "+c.counter)
		evs.waitFor(t, 20*time.Second, "exec.queued of the second exec", eventType("exec.queued"))
		c.d.kill()
		r1, r2 := first.wait(t, 30*time.Second), queued.wait(t, 30*time.Second)
		c.startDaemon()
		c.checkAfterCrashResult(r1, r2)
		if strings.Contains(readFileOr(c.counter), "queued-ran") {
			t.Error("the queued exec ran although the daemon died before its turn")
		}
	})
	crashCase(t, "sandboxd-lock-wait", false, func(t *testing.T) {
		c := newCrashEnv(t, "dkilllock")
		lc := c.lc
		holder, err := lc.sshTo(t, c.run).NewSession()
		if err != nil {
			t.Fatal(err)
		}
		if err := holder.Run("__rwx_sandbox_lock_requested__"); err != nil {
			t.Fatal(err)
		}
		before := lc.execRequests(t, c.run)
		b := c.nookBackground(c.repo, append([]string{"exec", "--"}, c.command()...)...)
		waitUntil(t, 20*time.Second, "the daemon's lock request", func() bool { return lc.execRequests(t, c.run) > before })
		c.d.kill()
		r := b.wait(t, 30*time.Second)
		// The other client goes away, and with it its lock.
		lc.dropHolder(t, c.run)
		c.startDaemon()
		c.checkAfterCrashResult(r)
		if lines(t, c.counter) != 0 {
			t.Error("the command ran although the daemon died waiting for the lock")
		}
	})
	crashCase(t, "localcloud-mid-exec", false, func(t *testing.T) {
		c := newCrashEnv(t, "lckill")
		b := c.nookBackground(c.repo, append([]string{"exec", "--"}, c.command()...)...)
		c.waitCommandStarted()
		pid := c.localcloudPID()
		syscall.Kill(pid, syscall.SIGKILL)
		waitUntil(t, 10*time.Second, "the local remote to die", func() bool { return syscall.Kill(pid, 0) != nil })
		r := b.wait(t, 60*time.Second)
		c.checkAfterCrashResult(r)
	})
}

// checkAfterCrashResult is checkAfterCrash for clients already ended.
func (c *crashEnv) checkAfterCrashResult(rs ...result) {
	c.t.Helper()
	for _, r := range rs {
		if r.code == 0 {
			c.t.Errorf("an exec cut by the crash reported success: %s", r)
		} else {
			checkFailure(c.t, "exec cut by the crash", r)
		}
	}
	c.checkAfterCrash()
}

// connectLocalcloud is a client of a running local remote.
func connectLocalcloud(t testing.TB, apiURL, certFile, tokenFile string) *localcloud {
	t.Helper()
	pem, err := os.ReadFile(certFile)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := os.ReadFile(tokenFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pem)
	return &localcloud{apiURL: apiURL, token: strings.TrimSpace(string(tok)), client: &http.Client{
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}, Timeout: 30 * time.Second,
	}}
}

func (c *crashEnv) localcloudPID() int {
	c.t.Helper()
	var d struct {
		PID int `json:"pid"`
	}
	discovery := filepath.Join(c.get("XDG_DATA_HOME"), "sandboxd", "localcloud", "localcloud.json")
	if err := json.Unmarshal([]byte(readFile(c.t, discovery)), &d); err != nil || d.PID == 0 {
		c.t.Fatalf("discovery file: %v", err)
	}
	return d.PID
}

// dropHolder ends every SSH connection to run (the lock holder's).
func (lc *localcloud) dropHolder(t testing.TB, run string) {
	lc.call(t, "POST", "/admin/runs/"+run+"/drop-connections", nil)
}

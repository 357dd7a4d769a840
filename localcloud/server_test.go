package localcloud

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/rwxapi"

	"github.com/sandboxd/sandboxd/localcloud/runs"
	"golang.org/x/crypto/ssh"
)

func TestRunLifecycleOverTheNetwork(t *testing.T) {
	isolate(t)
	srv := startServer(t, Config{})
	c := newClient(t, srv)
	def := repo(t, "tasks:\n  - key: deps\n    run: echo prepared > prepared.txt\n  - key: sandbox\n    run: rwx-sandbox\n")
	id := c.create(def, "")
	c.waitState(id, runs.Sandboxable)

	// The list echoes cli_state byte for byte.
	var list rwxapi.ListRunsResult
	c.call(200, "GET", rwxapi.PathRuns+"?result_status=sandboxed&execution_status=in_progress&my_runs=true", nil, &list)
	if len(list.Runs) != 1 || list.Runs[0].ID != id || list.Runs[0].CLIState != def.CLIState || list.Runs[0].Title != def.Title {
		t.Fatalf("list: %+v", list)
	}

	ci := c.connInfo(id)
	if !ci.Sandboxable || ci.Polling.Completed || ci.ExpiresAt == "" {
		t.Fatalf("connection info %+v", ci)
	}
	sc := dialSandbox(t, ci)
	out, code := output(t, sc, "cat README prepared.txt; /usr/bin/git rev-parse HEAD; echo $RWX_SANDBOX $HOME")
	if code != 0 || !strings.HasPrefix(out, "hello\nprepared\n"+def.Git.Sha+"\n1 ") {
		t.Fatalf("sandbox answered %d %q", code, out)
	}

	// __rwx_sandbox_end__ completes the run: 410 from then on.
	if out, code := output(t, sc, "__rwx_sandbox_end__"); code != 0 || out != "" {
		t.Fatalf("end: %d %q", code, out)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		status, body := c.raw("GET", rwxapi.PathConnectionInfo+"?sandbox_key="+id, nil)
		if status == http.StatusGone {
			var eb rwxapi.ErrorBody
			if json.Unmarshal(body, &eb) != nil || !strings.Contains(eb.Error, "ended") {
				t.Fatalf("410 body %s", body)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("run still answers %d after end", status)
		}
		time.Sleep(10 * time.Millisecond)
	}
	c.call(200, "GET", rwxapi.PathRuns+"?result_status=sandboxed&execution_status=in_progress&my_runs=true", nil, &list)
	if len(list.Runs) != 0 {
		t.Fatalf("ended run still listed: %+v", list)
	}
	if st := c.status(id); st.Reason != runs.ReasonEnded {
		t.Fatalf("status %+v", st)
	}
}

func TestNotFoundVersusGone(t *testing.T) {
	isolate(t)
	srv := startServer(t, Config{})
	c := newClient(t, srv)
	status, body := c.raw("GET", rwxapi.PathConnectionInfo+"?sandbox_key="+strings.Repeat("0", 32), nil)
	var eb rwxapi.ErrorBody
	if status != http.StatusNotFound || json.Unmarshal(body, &eb) != nil || eb.Error == "" {
		t.Fatalf("unknown run: %d %s", status, body)
	}
	id := c.create(repo(t, plainConfig), "")
	c.waitState(id, runs.Sandboxable)
	c.call(200, "POST", rwxapi.CancelPath(id), nil, nil)
	status, body = c.raw("GET", rwxapi.PathConnectionInfo+"?sandbox_key="+id, nil)
	if status != http.StatusGone || json.Unmarshal(body, &eb) != nil || !strings.Contains(eb.Error, "cancelled") {
		t.Fatalf("cancelled run: %d %s", status, body)
	}
	// Cancelled before it was a sandbox: 200, completed, with the reason
	// (what the RWX CLI reads).
	early := c.create(repo(t, "tasks:\n  - key: slow\n    run: sleep 30\n  - key: sandbox\n    run: rwx-sandbox\n"), "")
	c.call(200, "POST", rwxapi.CancelPath(early), nil, nil)
	if ci := c.connInfo(early); !ci.Polling.Completed || ci.Sandboxable || ci.FailureReason != "cancelled" {
		t.Fatalf("run cancelled while provisioning: %+v", ci)
	}
	// Cancel is idempotent.
	c.call(200, "POST", rwxapi.CancelPath(id), nil, nil)
	c.call(404, "POST", rwxapi.CancelPath(strings.Repeat("1", 32)), nil, nil)
}

func TestIdempotentCreate(t *testing.T) {
	isolate(t)
	srv := startServer(t, Config{})
	c := newClient(t, srv)
	def := repo(t, plainConfig)
	first := c.create(def, "key-1")
	if again := c.create(def, "key-1"); again != first {
		t.Fatalf("same key made a second run: %s then %s", first, again)
	}
	other := c.create(def, "key-2")
	if other == first {
		t.Fatal("another key returned the same run")
	}
	// Once its run is over, the key starts a new run.
	c.call(200, "POST", rwxapi.CancelPath(first), nil, nil)
	if next := c.create(def, "key-1"); next == first {
		t.Fatal("a finished run was returned for its key")
	}
	if n := len(srv.Runs().List(runs.Filter{})); n != 3 {
		t.Fatalf("%d runs, want 3", n)
	}
}

func TestFailingSetupStep(t *testing.T) {
	isolate(t)
	srv := startServer(t, Config{})
	c := newClient(t, srv)
	id := c.create(repo(t, "tasks:\n  - key: ok\n    run: echo fine\n  - key: broken\n    run: echo the-step-output; exit 4\n  - key: sandbox\n    run: rwx-sandbox\n"), "")
	st := waitCompleted(t, c, id)
	if st.Reason != runs.ReasonFailed || !strings.Contains(st.Detail, `"broken"`) || !strings.Contains(st.Detail, "the-step-output") {
		t.Fatalf("status %+v", st)
	}
	if b, _ := os.ReadFile(st.LogFile); !strings.Contains(string(b), "the-step-output") {
		t.Fatalf("run log: %s", b)
	}
	if ci := c.connInfo(id); !ci.Polling.Completed || ci.Sandboxable || ci.FailureReason != "failed" {
		t.Fatalf("connection info: %+v", ci)
	}
	status, body := c.raw("GET", rwxapi.PathResultsPrompt+"?id="+id, nil)
	if status != http.StatusOK || !strings.Contains(string(body), "Failed task: broken") || !strings.Contains(string(body), "the-step-output") {
		t.Fatalf("results/prompt: %d %s", status, body)
	}
}

func TestMissingOriginFailsTheRun(t *testing.T) {
	isolate(t)
	srv := startServer(t, Config{})
	c := newClient(t, srv)
	def := repo(t, plainConfig)
	def.Git.OriginURL = filepath.Join(t.TempDir(), "gone.git")
	st := waitCompleted(t, c, c.create(def, ""))
	if st.Reason != runs.ReasonFailed || !strings.Contains(st.Detail, def.Git.OriginURL) || !strings.Contains(st.Detail, "does not exist") {
		t.Fatalf("status %+v", st)
	}
	def = repo(t, plainConfig)
	def.Git.OriginURL = "http://127.0.0.1:1/nothing.git"
	st = waitCompleted(t, c, c.create(def, ""))
	if st.Reason != runs.ReasonFailed || !strings.Contains(st.Detail, "127.0.0.1:1") {
		t.Fatalf("unreachable origin: %+v", st)
	}
}

func waitCompleted(t *testing.T, c *client, id string) RunStatus {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		st := c.status(id)
		if st.State == runs.Completed {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("run %s still %s", id, st.State)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestCancelProvisioningRun(t *testing.T) {
	isolate(t)
	srv := startServer(t, Config{})
	c := newClient(t, srv)
	// The step is isolated: it reports through its workspace, and its
	// process is found on this side by its unique command line.
	id := c.create(repo(t, "tasks:\n  - key: slow\n    run: touch started; sleep 61.25\n  - key: sandbox\n    run: rwx-sandbox\n"), "")
	waitExists(t, filepath.Join(srv.Dir(), "runs", id, "workspace", "started"))
	pid := hostPID(t, "sleep 61.25")
	ci := c.connInfo(id)
	if ci.Sandboxable || ci.Polling.Completed || ci.Polling.BackoffMs <= 0 {
		t.Fatalf("provisioning connection info %+v", ci)
	}
	c.call(200, "POST", rwxapi.CancelPath(id), nil, nil)
	st := c.status(id)
	if st.State != runs.Completed || st.Reason != runs.ReasonCancelled {
		t.Fatalf("status after cancel %+v", st)
	}
	deadline := time.Now().Add(10 * time.Second)
	for alive(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("setup step %d survived the cancel", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func waitExists(t *testing.T, path string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := os.Stat(path); err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never appeared", path)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// hostPID finds, as seen from here, the one process whose command line is
// cmdline (a sandbox has its own PID numbers).
func hostPID(t *testing.T, cmdline string) int {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ents, _ := os.ReadDir("/proc")
		for _, e := range ents {
			pid, err := strconv.Atoi(e.Name())
			if err != nil {
				continue
			}
			b, _ := os.ReadFile("/proc/" + e.Name() + "/cmdline")
			if strings.ReplaceAll(strings.TrimRight(string(b), "\x00"), "\x00", " ") == cmdline {
				return pid
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no process %q", cmdline)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestDeadlinesAreStateAware(t *testing.T) {
	isolate(t)
	clock := &fakeClock{now: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
	srv := startServer(t, Config{Clock: clock, IdleTimeout: time.Hour, MaxLifetime: 24 * time.Hour, SweepInterval: time.Hour})
	c := newClient(t, srv)
	slow := c.create(repo(t, "tasks:\n  - key: wait\n    run: while [ ! -e gate ]; do sleep 0.02; done\n  - key: sandbox\n    run: rwx-sandbox\n"), "")
	gate := filepath.Join(srv.Dir(), "runs", slow, "workspace", "gate") // the sandbox sees only its workspace
	idle := c.create(repo(t, plainConfig), "")
	c.waitState(idle, runs.Sandboxable)

	clock.Advance(59 * time.Minute)
	srv.Sweep()
	c.waitState(idle, runs.Sandboxable)

	clock.Advance(2 * time.Minute)
	srv.Sweep()
	if st := c.status(idle); st.Reason != runs.ReasonTimedOut || !strings.Contains(st.Detail, "idle") {
		t.Fatalf("idle run: %+v", st)
	}
	// The idle deadline is for sandboxable runs: provisioning continues.
	if st := c.status(slow); st.State != runs.Provisioning {
		t.Fatalf("provisioning run was ended by the idle deadline: %+v", st)
	}
	waitExists(t, filepath.Dir(gate))
	os.WriteFile(gate, nil, 0o644)
	c.waitState(slow, runs.Sandboxable)

	// Activity (an exec) pushes the idle deadline.
	ci := c.connInfo(slow)
	sc := dialSandbox(t, ci)
	clock.Advance(50 * time.Minute)
	output(t, sc, "true")
	clock.Advance(50 * time.Minute)
	srv.Sweep()
	c.waitState(slow, runs.Sandboxable)

	// The lifetime deadline ends it whatever the activity.
	clock.Advance(23 * time.Hour)
	output(t, sc, "true")
	srv.Sweep()
	if st := c.status(slow); st.Reason != runs.ReasonTimedOut || !strings.Contains(st.Detail, "maximum lifetime") {
		t.Fatalf("lifetime: %+v", st)
	}
}

func TestBadInputChangesNothing(t *testing.T) {
	isolate(t)
	srv := startServer(t, Config{})
	c := newClient(t, srv)
	def := repo(t, plainConfig)
	withDef := func(f func(*rwxapi.RunDefinition)) rwxapi.CreateRunRequest {
		d := def
		d.TaskDefinitions = append([]rwxapi.DirectoryEntry{}, def.TaskDefinitions...)
		d.MintDirectory = append([]rwxapi.DirectoryEntry{}, def.MintDirectory...)
		f(&d)
		return rwxapi.CreateRunRequest{Run: d}
	}
	cases := []struct {
		name   string
		body   any
		status int
		msg    string
	}{
		{"malformed JSON", []byte(`{"run": {`), 400, "malformed JSON"},
		{"empty body", []byte(``), 400, "empty"},
		{"trailing data", []byte(`{"run":{}} {}`), 400, "after the JSON"},
		{"wrong type", []byte(`{"run":{"use_cache":"yes","git":{"origin_url":"/x"}}}`), 400, "use_cache"},
		{"wrong type nested", []byte(`{"run":{"git":{"sha":42}}}`), 400, "sha"},
		{"missing origin", withDef(func(d *rwxapi.RunDefinition) { d.Git.OriginURL = "" }), 400, "origin_url is missing"},
		{"relative origin", withDef(func(d *rwxapi.RunDefinition) { d.Git.OriginURL = "../origin.git" }), 400, "relative path"},
		{"option as origin", withDef(func(d *rwxapi.RunDefinition) { d.Git.OriginURL = "--upload-pack=evil" }), 400, "not a repository"},
		{"bad sha", withDef(func(d *rwxapi.RunDefinition) { d.Git.Sha = "main; rm -rf /" }), 400, "not a commit id"},
		{"path outside", withDef(func(d *rwxapi.RunDefinition) {
			d.MintDirectory = append(d.MintDirectory, rwxapi.DirectoryEntry{Path: "../../escape", Type: "file", FileContents: "x"})
		}), 400, "outside"},
		{"absolute path", withDef(func(d *rwxapi.RunDefinition) { d.TaskDefinitions[0].Path = "/etc/passwd" }), 400, "relative path"},
		{"no config", withDef(func(d *rwxapi.RunDefinition) { d.TaskDefinitions = nil }), 400, "task_definitions"},
		{"config without sandbox task", withDef(func(d *rwxapi.RunDefinition) {
			d.TaskDefinitions[0].FileContents = "tasks:\n  - key: a\n    run: echo\n"
		}), 400, "rwx-sandbox"},
		{"too large", []byte(`{"run":{"title":"` + strings.Repeat("x", maxBody) + `"}}`), 413, "larger"},
	}
	for _, tc := range cases {
		status, body := c.raw("POST", rwxapi.PathRuns, tc.body)
		var eb rwxapi.ErrorBody
		if status != tc.status || json.Unmarshal(body, &eb) != nil || !strings.Contains(eb.Error, tc.msg) {
			t.Errorf("%s: %d %s, want %d with %q", tc.name, status, body, tc.status, tc.msg)
		}
	}
	c.call(404, "GET", rwxapi.PathConnectionInfo+"?sandbox_key=../../etc", nil, nil)
	c.call(404, "POST", rwxapi.CancelPath("nope"), nil, nil)
	c.call(400, "GET", rwxapi.PathConnectionInfo, nil, nil)
	c.call(400, "GET", rwxapi.PathRuns+"?execution_status=sideways", nil, nil)
	c.call(404, "GET", "/mint/api/nothing", nil, nil)
	c.call(405, "DELETE", rwxapi.PathRuns, nil, nil)

	wrong := *c
	wrong.token = "lca_wrong"
	status, body := wrong.raw("POST", rwxapi.PathRuns, rwxapi.CreateRunRequest{Run: def})
	if status != 401 || !strings.Contains(string(body), `"error"`) {
		t.Errorf("wrong token: %d %s", status, body)
	}
	none := *c
	none.token = ""
	if status, _ := none.raw("GET", rwxapi.PathLeaves, nil); status != 401 {
		t.Errorf("no token: %d", status)
	}
	if n := len(srv.Runs().List(runs.Filter{})); n != 0 {
		t.Fatalf("bad input created %d runs", n)
	}
	entries, _ := os.ReadDir(filepath.Join(srv.Dir(), "runs"))
	if len(entries) != 0 {
		t.Fatalf("bad input left run directories: %v", entries)
	}
}

func TestScopedTokens(t *testing.T) {
	isolate(t)
	srv := startServer(t, Config{})
	c := newClient(t, srv)
	def := repo(t, plainConfig)
	a, b := c.create(def, ""), c.create(def, "")
	var tok rwxapi.SandboxToken
	c.call(201, "POST", rwxapi.PathSandboxTokens, rwxapi.SandboxTokenRequest{RunID: a}, &tok)
	if tok.RunID != a || !strings.HasPrefix(tok.Token, "lcs_") || tok.ExpiresAt == "" {
		t.Fatalf("token %+v", tok)
	}
	scoped := *c
	scoped.token = tok.Token
	scoped.call(200, "GET", rwxapi.PathConnectionInfo+"?sandbox_key="+a, nil, nil)
	scoped.call(403, "GET", rwxapi.PathConnectionInfo+"?sandbox_key="+b, nil, nil)
	scoped.call(403, "GET", rwxapi.PathRuns, nil, nil)
	scoped.call(403, "POST", "/admin/faults", map[string]any{"error_rate_5xx": 1}, nil)
	scoped.call(200, "POST", rwxapi.CancelPath(a), nil, nil)
	c.call(400, "POST", rwxapi.PathSandboxTokens, rwxapi.SandboxTokenRequest{RunID: b, ExpiresInSeconds: -5}, nil)
	c.call(404, "POST", rwxapi.PathSandboxTokens, rwxapi.SandboxTokenRequest{RunID: strings.Repeat("a", 32)}, nil)
	c.call(410, "POST", rwxapi.PathSandboxTokens, rwxapi.SandboxTokenRequest{RunID: a}, nil)
}

func TestSideEndpointsOfTheRWXCLI(t *testing.T) {
	isolate(t)
	srv := startServer(t, Config{})
	c := newClient(t, srv)
	var leaves struct {
		LatestMajor map[string]string `json:"latest_major"`
	}
	c.call(200, "GET", rwxapi.PathLeaves, nil, &leaves)
	if leaves.LatestMajor == nil {
		t.Fatal("leaves answer lacks latest_major")
	}
	c.call(404, "GET", rwxapi.PathSkillLatest, nil, nil)
	if status, _ := c.raw("POST", rwxapi.PathTelemetry, []byte(`[{"event":"x"}]`)); status != 204 {
		t.Fatalf("telemetry %d", status)
	}
	var base struct{ Image, Config, Arch string }
	c.call(200, "GET", rwxapi.PathBaseDefault, nil, &base)
	if base.Image == "" || base.Config == "" || base.Arch == "" {
		t.Fatalf("base %+v", base)
	}
	var tmpl rwxapi.InitTemplateResult
	c.call(200, "GET", rwxapi.PathInitTemplate, nil, &tmpl)
	if !strings.Contains(tmpl.Template, "run: rwx-sandbox") {
		t.Fatalf("template %q", tmpl.Template)
	}
}

func TestFaultInjection(t *testing.T) {
	isolate(t)
	srv := startServer(t, Config{})
	c := newClient(t, srv)
	id := c.create(repo(t, plainConfig), "")
	c.waitState(id, runs.Sandboxable)

	c.call(200, "POST", "/admin/faults", map[string]any{"error_rate_5xx": 1.0}, nil)
	c.call(503, "GET", rwxapi.PathRuns, nil, nil)
	c.call(503, "GET", rwxapi.PathConnectionInfo+"?sandbox_key="+id, nil, nil)
	c.call(200, "POST", "/admin/faults", map[string]any{"error_rate_5xx": 0.0, "latency_ms": 50}, nil)
	start := time.Now()
	c.call(200, "GET", rwxapi.PathRuns, nil, nil)
	if time.Since(start) < 50*time.Millisecond {
		t.Fatal("latency was not injected")
	}
	c.call(400, "POST", "/admin/faults", map[string]any{"error_rate_5xx": 2}, nil)
	var f Faults
	c.call(200, "POST", "/admin/faults", map[string]any{"latency_ms": 0}, &f)
	if f != (Faults{}) {
		t.Fatalf("faults %+v", f)
	}

	ci := c.connInfo(id)
	cl := dialSandbox(t, ci)
	output(t, cl, "true") // the agent has registered the connection
	var dropped map[string]int
	c.call(200, "POST", "/admin/runs/"+id+"/drop-connections", nil, &dropped)
	if dropped["dropped"] != 1 {
		t.Fatalf("dropped %v", dropped)
	}
	if _, err := cl.NewSession(); err == nil {
		t.Fatal("connection survived drop-connections")
	}
	dialSandbox(t, ci) // a new one works

	c.call(200, "POST", "/admin/faults", map[string]any{"drop_ssh": true}, nil)
	if _, err := sshDial(ci); err == nil {
		t.Fatal("a connection was accepted while drop_ssh is on")
	}
	c.call(200, "POST", "/admin/faults", map[string]any{"drop_ssh": false}, nil)
	out, _ := output(t, dialSandbox(t, ci), "echo back")
	if out != "back\n" {
		t.Fatalf("after drop_ssh: %q", out)
	}
}

func TestRestartKeepsRunsAndCompletesLostWorkspaces(t *testing.T) {
	isolate(t)
	dir := filepath.Join(t.TempDir(), "state")
	srv := startServer(t, Config{Dir: dir})
	c := newClient(t, srv)
	keep := c.create(repo(t, plainConfig), "")
	lose := c.create(repo(t, plainConfig), "")
	c.waitState(keep, runs.Sandboxable)
	c.waitState(lose, runs.Sandboxable)
	before := c.connInfo(keep)
	if err := srv.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadDiscovery(dir); err == nil {
		t.Fatal("discovery file left after a graceful stop")
	}
	os.RemoveAll(srv.Runs().Workspace(lose))

	srv2 := startServer(t, Config{Dir: dir})
	c2 := newClient(t, srv2)
	after := c2.connInfo(keep)
	if after.PublicHostKey != before.PublicHostKey || userKey(t, after) != userKey(t, before) {
		t.Fatal("keys changed across the restart")
	}
	out, _ := output(t, dialSandbox(t, after), "cat README")
	if out != "hello\n" {
		t.Fatalf("after restart: %q", out)
	}
	st := c2.status(lose)
	if st.State != runs.Completed || st.Reason != runs.ReasonFailed || !strings.Contains(st.Detail, "gone") {
		t.Fatalf("run without workspace: %+v", st)
	}
}

// TestRehydrationAfterSIGKILL kills a real server process and starts a new
// one: an SSH client with the keys it had reconnects and runs a command.
func TestRehydrationAfterSIGKILL(t *testing.T) {
	isolate(t)
	dir := filepath.Join(t.TempDir(), "state")
	start := func() *exec.Cmd {
		cmd := exec.Command(os.Args[0], "serve", "--state-dir", dir)
		cmd.Env = append(os.Environ(), asBinaryEnv+"=1")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd
	}
	first := start()
	d := waitDiscovery(t, dir, first.Process.Pid)
	c := discoveryClient(t, d)
	id := c.create(repo(t, plainConfig), "")
	c.waitState(id, runs.Sandboxable)
	before := c.connInfo(id)
	status := c.status(id)
	output(t, dialSandbox(t, before), "true")

	first.Process.Kill()
	first.Wait()
	second := start()
	d2 := waitDiscovery(t, dir, second.Process.Pid)
	c2 := discoveryClient(t, d2)
	after := c2.connInfo(id)
	if userKey(t, after) != userKey(t, before) || after.PublicHostKey != before.PublicHostKey {
		t.Fatal("keys changed across SIGKILL")
	}
	// The client reconnects with what it had (same address when the port
	// was free, which it is here).
	if after.Address != before.Address {
		t.Logf("agent moved from %s to %s", before.Address, after.Address)
	}
	out, code := output(t, dialSandbox(t, after), "cat README")
	if code != 0 || out != "hello\n" {
		t.Fatalf("after SIGKILL: %d %q", code, out)
	}
	st2 := c2.status(id)
	if !st2.ExpiresAt.Equal(status.ExpiresAt) || !st2.CreatedAt.Equal(status.CreatedAt) {
		t.Fatalf("deadlines changed: %v → %v", status.ExpiresAt, st2.ExpiresAt)
	}
}

func waitDiscovery(t *testing.T, dir string, pid int) Discovery {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		d, err := Status(context.Background(), dir)
		if err == nil && d.PID == pid {
			return d
		}
		if time.Now().After(deadline) {
			t.Fatalf("no live server %d in %s: %v", pid, dir, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func discoveryClient(t *testing.T, d Discovery) *client {
	t.Helper()
	hc, token, err := d.Client()
	if err != nil {
		t.Fatal(err)
	}
	hc.Timeout = 30 * time.Second
	return &client{t: t, base: d.APIURL, token: token, http: hc}
}

func TestSecondServerRefused(t *testing.T) {
	isolate(t)
	srv := startServer(t, Config{})
	other, err := New(Config{Dir: srv.Dir()})
	if err != nil {
		t.Fatal(err)
	}
	err = other.Start(context.Background())
	if err == nil || !strings.Contains(err.Error(), "already running") {
		t.Fatalf("second server: %v", err)
	}
	// The refused one did not touch the running one's discovery file.
	if _, err := Status(context.Background(), srv.Dir()); err != nil {
		t.Fatal(err)
	}
}

func TestDamagedRegistryIsReportedNotReplaced(t *testing.T) {
	isolate(t)
	dir := filepath.Join(t.TempDir(), "state")
	os.MkdirAll(dir, 0o700)
	os.WriteFile(filepath.Join(dir, runs.StateFile), []byte("{not json"), 0o600)
	srv, err := New(Config{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	err = srv.Start(context.Background())
	if err == nil || !strings.Contains(err.Error(), runs.StateFile) {
		t.Fatalf("damaged registry: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, runs.StateFile)); string(b) != "{not json" {
		t.Fatal("damaged registry was overwritten")
	}
}

// userKey is the public half of the private user key (its PEM differs at
// each encoding: OpenSSH adds a random check value).
func userKey(t *testing.T, ci rwxapi.ConnectionInfo) string {
	t.Helper()
	k, err := ssh.ParsePrivateKey([]byte(ci.PrivateUserKey))
	if err != nil {
		t.Fatal(err)
	}
	return string(k.PublicKey().Marshal())
}

// BenchmarkProvisionSmallRepo measures create → sandboxable for a small
// repository (a local origin, no setup steps): clone, checkout, agent start.
func BenchmarkProvisionSmallRepo(b *testing.B) {
	isolate(b)
	srv := startServer(b, Config{})
	c := newClient(b, srv)
	def := repo(b, plainConfig)
	for b.Loop() {
		id := c.create(def, "")
		for {
			ci := c.connInfo(id)
			if ci.Sandboxable {
				break
			}
			time.Sleep(time.Millisecond)
		}
		b.StopTimer()
		c.call(200, "POST", rwxapi.CancelPath(id), nil, nil)
		b.StartTimer()
	}
}

// TestFaultInjectionNeedsItsFlag: a remote started without
// EnableFaultInjection (serve without --enable-fault-injection) has no
// fault routes, whoever asks, and refuses fault settings.
func TestFaultInjectionNeedsItsFlag(t *testing.T) {
	isolate(t)
	srv, err := New(Config{Dir: filepath.Join(t.TempDir(), "state")})
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close(context.Background()) })
	c := newClient(t, srv)
	c.call(404, "GET", "/admin/faults", nil, nil)
	c.call(404, "POST", "/admin/faults", map[string]any{"error_rate_5xx": 1.0}, nil)
	c.call(404, "POST", "/admin/runs/x/drop-connections", nil, nil)
	c.call(200, "GET", rwxapi.PathRuns, nil, nil)
	if _, err := New(Config{Dir: filepath.Join(t.TempDir(), "state"), Faults: Faults{ErrorRate5xx: 0.5}}); err == nil || !strings.Contains(err.Error(), "--enable-fault-injection") {
		t.Fatalf("faults without the flag: %v", err)
	}
}

// TestListenRefusesAddressesBeyondLoopback: the runs API (which hands out
// SSH keys) binds all interfaces only when asked to in so many words.
func TestListenRefusesAddressesBeyondLoopback(t *testing.T) {
	for _, addr := range []string{"0.0.0.0:0", ":0", "[::]:0", "192.0.2.1:0"} {
		for _, cfg := range []Config{{Listen: addr}, {HTTPListen: addr}} {
			cfg.Dir = filepath.Join(t.TempDir(), "state")
			if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), "--allow-remote") {
				t.Errorf("%+v: %v", cfg, err)
			}
			cfg.AllowRemote = true
			if _, err := New(cfg); err != nil {
				t.Errorf("%+v with AllowRemote: %v", cfg, err)
			}
		}
	}
	for _, addr := range []string{"127.0.0.1:0", "localhost:0", "[::1]:0"} {
		if _, err := New(Config{Dir: filepath.Join(t.TempDir(), "state"), Listen: addr}); err != nil {
			t.Errorf("%s: %v", addr, err)
		}
	}
}

// TestSIGKILLedServerLeavesNoCommandRunning: a command running in a sandbox
// when the server is SIGKILLed dies with it, instead of running on under
// init with nobody to report its result to.
//
// Without isolation (isolation none): what the command started in the
// background is ended by the next server; with isolation see
// TestSIGKILLedServerTakesItsSandboxesAlong.
func TestSIGKILLedServerLeavesNoCommandRunning(t *testing.T) {
	isolate(t)
	dir := filepath.Join(t.TempDir(), "state")
	cmd := exec.Command(os.Args[0], "serve", "--state-dir", dir, "--isolation", "none")
	cmd.Env = append(os.Environ(), asBinaryEnv+"=1")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	c := discoveryClient(t, waitDiscovery(t, dir, cmd.Process.Pid))
	id := c.create(repo(t, plainConfig), "")
	c.waitState(id, runs.Sandboxable)
	sc := dialSandbox(t, c.connInfo(id))
	pidFile := filepath.Join(t.TempDir(), "pid")
	s, err := sc.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start("echo $$ > " + pidFile + "; exec sleep 300"); err != nil {
		t.Fatal(err)
	}
	var pid int
	deadline := time.Now().Add(20 * time.Second)
	for pid == 0 {
		if b, err := os.ReadFile(pidFile); err == nil {
			fmt.Sscan(string(b), &pid)
		}
		if time.Now().After(deadline) {
			t.Fatal("the command did not start")
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	if !alive(pid) {
		t.Fatalf("sleep %d is not running", pid)
	}
	// What it started in the background survives it; the next server of
	// the state directory ends that.
	s2, err := sc.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	bgFile := filepath.Join(t.TempDir(), "bgpid")
	if out, err := s2.CombinedOutput("sleep 301 >/dev/null 2>&1 & echo $! > " + bgFile); err != nil {
		t.Fatalf("background command: %v %s", err, out)
	}
	var bg int
	if b, err := os.ReadFile(bgFile); err != nil || func() bool { _, err := fmt.Sscan(string(b), &bg); return err != nil }() {
		t.Fatalf("background pid: %v", err)
	}
	t.Cleanup(func() { syscall.Kill(bg, syscall.SIGKILL) })
	cmd.Process.Kill()
	cmd.Wait()
	deadline = time.Now().Add(20 * time.Second)
	for alive(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("the command (pid %d) still runs after its server was SIGKILLed", pid)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !alive(bg) {
		t.Fatalf("the background process %d died with the server already: the restart case is not tested", bg)
	}
	next := exec.Command(os.Args[0], "serve", "--state-dir", dir, "--isolation", "none")
	next.Env = append(os.Environ(), asBinaryEnv+"=1")
	if err := next.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { next.Process.Kill(); next.Wait() })
	waitDiscovery(t, dir, next.Process.Pid)
	deadline = time.Now().Add(20 * time.Second)
	for alive(bg) {
		if time.Now().After(deadline) {
			t.Fatalf("the background process %d left by the killed server still runs after a restart", bg)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// parentComm is the name of pid's parent.
func parentComm(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	comm, _ := os.ReadFile("/proc/" + f[1] + "/comm")
	return strings.TrimSpace(string(comm))
}

// alive reports whether pid runs (a zombie waiting for init is not).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && i+2 < len(s) {
		return s[i+2] != 'Z' && s[i+2] != 'X'
	}
	return true
}

// TestSIGKILLedServerTakesItsSandboxesAlong: with isolation, a SIGKILLed
// server's sandboxes die with it, commands and background processes alike
// (the end of a PID namespace's init ends all of it).
func TestSIGKILLedServerTakesItsSandboxesAlong(t *testing.T) {
	isolate(t)
	dir := filepath.Join(t.TempDir(), "state")
	cmd := exec.Command(os.Args[0], "serve", "--state-dir", dir)
	cmd.Env = append(os.Environ(), asBinaryEnv+"=1")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	c := discoveryClient(t, waitDiscovery(t, dir, cmd.Process.Pid))
	id := c.create(repo(t, plainConfig), "")
	c.waitState(id, runs.Sandboxable)
	sc := dialSandbox(t, c.connInfo(id))
	s, err := sc.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start("exec sleep 300.5"); err != nil {
		t.Fatal(err)
	}
	fg := hostPID(t, "sleep 300.5")
	// Started by the sandbox's spawner (what must die with the server
	// too), one PID namespace down.
	if comm := parentComm(t, fg); comm != "sandbox-spawner" {
		t.Fatalf("the command's parent is %q, want the sandbox's spawner", comm)
	}
	if st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", fg)); !regexp.MustCompile(`(?m)^NSpid:\s+\d+\s+\d+$`).Match(st) {
		t.Fatalf("the command is not one PID namespace down:\n%s", st)
	}
	s2, err := sc.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	if out, err := s2.CombinedOutput("setsid sleep 301.5 >/dev/null 2>&1 &"); err != nil {
		t.Fatalf("background command: %v %s", err, out)
	}
	bg := hostPID(t, "sleep 301.5")
	t.Cleanup(func() { syscall.Kill(fg, syscall.SIGKILL); syscall.Kill(bg, syscall.SIGKILL) })
	cmd.Process.Kill()
	cmd.Wait()
	deadline := time.Now().Add(20 * time.Second)
	for alive(fg) || alive(bg) {
		if time.Now().After(deadline) {
			t.Fatalf("the sandbox's processes (%d alive %v, %d alive %v) outlived their SIGKILLed server", fg, alive(fg), bg, alive(bg))
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The run's cgroups (where this machine gives them) stay behind
	// empty; the next server of any state directory removes them.
	left := runCgroups(t, cmd.Process.Pid)
	if len(left) == 0 {
		t.Log("no run cgroups here: their cleanup is not tested")
		return
	}
	next := exec.Command(os.Args[0], "serve", "--state-dir", filepath.Join(t.TempDir(), "state"))
	next.Env = append(os.Environ(), asBinaryEnv+"=1")
	if err := next.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { next.Process.Kill(); next.Wait() })
	waitDiscovery(t, filepath.Join(filepath.Dir(next.Args[3]), "state"), next.Process.Pid)
	for _, d := range left {
		if _, err := os.Stat(d); err == nil {
			t.Errorf("the cgroup %s of the SIGKILLed server is still there after the next server started", d)
		}
	}
}

// runCgroups lists the run cgroups server pid made (named
// <hostname>-<pid>-<seq> below <controller>/<own group>/sandboxd).
func runCgroups(t *testing.T, pid int) []string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil
	}
	var found []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 || f[1] == "" {
			continue
		}
		for _, c := range strings.Split(f[1], ",") {
			m, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", c, f[2], "sandboxd", fmt.Sprintf("nook-*-%d-*", pid)))
			found = append(found, m...)
		}
	}
	return found
}

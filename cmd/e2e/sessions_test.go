package e2e

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

type startJSON struct {
	Session struct {
		ID     string `json:"id"`
		RunID  string `json:"runId"`
		Status string `json:"status"`
		Branch string `json:"branch"`
	} `json:"session"`
	Created bool `json:"created"`
}

type execJSON struct {
	RunID       string   `json:"runId"`
	ExitCode    int      `json:"exitCode"`
	RunURL      string   `json:"runUrl"`
	PulledFiles []string `json:"pulledFiles"`
}

type listJSON struct {
	Sessions []struct {
		ID         string `json:"id"`
		RunID      string `json:"runId"`
		Status     string `json:"status"`
		Reason     string `json:"reason"`
		Branch     string `json:"branch"`
		RepoRoot   string `json:"repoRoot"`
		ExecCount  int    `json:"execCount"`
		ConfigFile string `json:"configFile"`
	} `json:"sessions"`
}

// decode decodes nook's JSON output: the object of a command, or the last
// record of a stream (`exec --json` ends with its result).
func decode[T any](t testing.TB, s string) T {
	t.Helper()
	var v T
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &v); err != nil {
		t.Fatalf("decode %q: %v", s, err)
	}
	return v
}

// startSandbox starts and waits for the sandbox of repo, returning its run id.
func (e *env) startSandbox(repo string) string {
	e.t.Helper()
	r := e.mustNook(repo, "start", "--wait", "--json")
	st := decode[startJSON](e.t, r.stdout)
	if st.Session.RunID == "" || st.Session.Status != "ready" {
		e.t.Fatalf("start did not give a ready session: %s", r)
	}
	return st.Session.RunID
}

func TestStartExecListStopLifecycle(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("life", defaultConfig)

	run := e.startSandbox(repo)
	again := decode[startJSON](t, e.mustNook(repo, "start", "--json").stdout)
	if again.Created || again.Session.RunID != run {
		t.Fatalf("second start must report the active session %s, got %+v", run, again)
	}

	r := e.mustNook(repo, "exec", "--no-sync", "--", "bash", "-c", "echo hello world")
	if r.stdout != "hello world\n" {
		t.Fatalf("stdout = %q", r.stdout)
	}
	r = e.mustNook(repo, "exec", "--no-sync", "--json", "--", "true")
	ej := decode[execJSON](t, r.stdout)
	if ej.RunID != run || ej.ExitCode != 0 || ej.PulledFiles == nil {
		t.Fatalf("exec --json = %+v", ej)
	}

	lj := decode[listJSON](t, e.mustNook(repo, "list", "--json").stdout)
	if len(lj.Sessions) != 1 || lj.Sessions[0].RunID != run || lj.Sessions[0].Status != "ready" || lj.Sessions[0].Branch != "main" {
		t.Fatalf("list = %+v", lj)
	}
	if strings.Contains(e.mustNook(repo, "list", "--json").stdout, "token") {
		t.Fatal("list must never return the token")
	}

	st := e.mustNook(repo, "status", "--json")
	probe := decode[struct {
		Probe     string `json:"probe"`
		Lifecycle struct {
			ExecCount int `json:"execCount"`
		} `json:"lifecycle"`
	}](t, st.stdout)
	if probe.Probe != "connected" || probe.Lifecycle.ExecCount != 2 {
		t.Fatalf("status = %s", st)
	}

	e.mustNook(repo, "stop")
	e.mustNook(repo, "stop") // idempotent
	all := decode[listJSON](t, e.mustNook(repo, "list", "--all", "--json").stdout)
	if len(all.Sessions) != 1 || all.Sessions[0].Status != "stopped" {
		t.Fatalf("list --all after stop = %+v", all)
	}
	if active := decode[listJSON](t, e.mustNook(repo, "list", "--json").stdout); len(active.Sessions) != 0 {
		t.Fatalf("list after stop = %+v", active)
	}
}

func TestExitCodesAndQuoting(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("codes", defaultConfig)
	e.startSandbox(repo)
	for _, want := range []int{0, 1, 7} {
		r := e.nook(repo, "exec", "--no-sync", "--", "sh", "-c", "exit "+strconv.Itoa(want))
		if r.code != want {
			t.Fatalf("exit %d: got %s", want, r)
		}
	}
	// A command killed by SIGINT exits 130, as in a shell.
	if r := e.nook(repo, "exec", "--no-sync", "--", "sh", "-c", "kill -INT $$"); r.code != 130 {
		t.Fatalf("signal death: %s", r)
	}
	// 125: the command never ran (no such run).
	if r := e.nook(repo, "exec", "--no-sync", "--id", "run-that-does-not-exist", "--", "true"); r.code != 125 {
		t.Fatalf("failure before the command: %s", r)
	}
	hostile := []string{"it's", `"q"`, "$HOME", "*", "a b", "new\nline", "ünï", "`id`", "$(id)", ";", "|", ""}
	r := e.mustNook(repo, append([]string{"exec", "--no-sync", "--", "printf", `%s\n`}, hostile...)...)
	if want := strings.Join(hostile, "\n") + "\n"; r.stdout != want {
		t.Fatalf("hostile argv came back as %q, want %q", r.stdout, want)
	}
}

func TestStdinStreamsAndSubdirectory(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("stdin", defaultConfig)
	run := e.startSandbox(repo)
	payload := strings.Repeat("0123456789", 100000) // 1 MB
	r := e.nookIn(repo, strings.NewReader(payload), "exec", "--no-sync", "--", "sh", "-c", "wc -c")
	if r.code != 0 || strings.TrimSpace(r.stdout) != "1000000" {
		t.Fatalf("stdin: %s", r)
	}
	r = e.mustNook(repo, "exec", "--no-sync", "--", "sh", "-c", "echo out; echo err >&2")
	if r.stdout != "out\n" || !strings.Contains(r.stderr, "err\n") {
		t.Fatalf("stdout/stderr separation: %s", r)
	}
	sub := filepath.Join(repo, "a", "b")
	if err := os.MkdirAll(sub, 0o755); err != nil {
		t.Fatal(err)
	}
	ej := decode[execJSON](t, e.mustNook(sub, "exec", "--no-sync", "--root", "--json", "--", "true").stdout)
	if ej.RunID != run {
		t.Fatalf("a subdirectory must find the same session: %s vs %s", ej.RunID, run)
	}
	// Outside a repository: a clear error, exit 125.
	out := filepath.Join(e.root, "outside")
	os.MkdirAll(out, 0o755)
	if r := e.nook(out, "exec", "--no-sync", "--", "true"); r.code != 125 || !strings.Contains(r.stderr, "not inside a git repository") {
		t.Fatalf("outside a repo: %s", r)
	}
}

func TestCtrlCReachesTheRemoteCommand(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("sigint", defaultConfig)
	e.startSandbox(repo)
	e.interruptExec(t, repo, "--no-sync", "")
}

// interruptExec runs nook exec (with flag, if any) of a command that first
// runs before (a shell line, or nothing), then traps SIGINT, and sends
// nook SIGINT once the command runs: the signal must reach the remote
// command's process group, as Ctrl-C in a terminal does.
func (e *env) interruptExec(t *testing.T, repo, flag, before string) {
	t.Helper()
	marker := filepath.Join(e.root, "got-int")
	_ = os.Remove(marker)
	args := []string{"exec"}
	if flag != "" {
		args = append(args, flag)
	}
	if before != "" {
		before += "; "
	}
	cmd := e.nookCmd(repo, append(args, "--", "sh", "-c", before+`trap 'echo got INT > `+marker+`; exit 42' INT; echo ready; while :; do sleep 0.05; done`)...)
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 6)
	if _, err := io.ReadFull(stdout, buf); err != nil || string(buf) != "ready\n" {
		t.Fatalf("command did not start: %q %v", buf, err)
	}
	_ = cmd.Process.Signal(syscall.SIGINT)
	err := cmd.Wait()
	// The trapping shell exits 42, and the wrapping /bin/sh, interrupted
	// too, may report death by SIGINT (130) first.
	var ee interface{ ExitCode() int }
	if !errors.As(err, &ee) || (ee.ExitCode() != 42 && ee.ExitCode() != 130) {
		t.Fatalf("nook after Ctrl-C: %v (want the remote status 42 or 130)", err)
	}
	waitUntil(t, 5*time.Second, "the remote trap to run", func() bool {
		b, _ := os.ReadFile(marker)
		return string(b) == "got INT\n"
	})
}

// TestManyCallersOneSandbox: 30 nook processes started at once on a branch
// with no session create exactly one run; their commands never overlap and
// none is lost.
func TestManyCallersOneSandbox(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("race", defaultConfig)
	const n = 30
	logFile := filepath.Join(e.root, "spans")
	var wg sync.WaitGroup
	results := make([]result, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Each command records its start and end in nanoseconds.
			script := `s=$(date +%s%N); sleep 0.02; echo "$s $(date +%s%N) ` + strconv.Itoa(i) + `" >> ` + logFile
			results[i] = e.nook(repo, "exec", "--no-sync", "--json", "--", "sh", "-c", script)
		}()
	}
	wg.Wait()
	runs := map[string]bool{}
	for i, r := range results {
		if r.code != 0 {
			t.Fatalf("caller %d: %s", i, r)
		}
		runs[decode[execJSON](t, r.stdout).RunID] = true
	}
	if len(runs) != 1 {
		t.Fatalf("%d runs created, want exactly 1: %v", len(runs), runs)
	}
	lj := decode[listJSON](t, e.mustNook(repo, "list", "--all", "--json").stdout)
	if len(lj.Sessions) != 1 {
		t.Fatalf("the remote and the store must know one session, got %+v", lj)
	}
	type span struct{ start, end int64 }
	var spans []span
	for _, line := range strings.Split(strings.TrimSpace(readFile(t, logFile)), "\n") {
		f := strings.Fields(line)
		s, _ := strconv.ParseInt(f[0], 10, 64)
		en, _ := strconv.ParseInt(f[1], 10, 64)
		spans = append(spans, span{s, en})
	}
	if len(spans) != n {
		t.Fatalf("%d commands ran, want %d", len(spans), n)
	}
	sort.Slice(spans, func(i, j int) bool { return spans[i].start < spans[j].start })
	for i := 1; i < len(spans); i++ {
		if spans[i].start < spans[i-1].end {
			t.Fatalf("commands overlapped: %v and %v", spans[i-1], spans[i])
		}
	}
}

func TestDetachedHeadAndBranchSessions(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("detached", defaultConfig)
	e.git(repo, "checkout", "-q", "--detach")
	first := decode[execJSON](t, e.mustNook(repo, "exec", "--no-sync", "--json", "--", "true").stdout).RunID
	// A new commit on the detached HEAD: the session of its ancestor is adopted.
	writeFile(t, filepath.Join(repo, "x.txt"), "x\n")
	e.git(repo, "add", "x.txt")
	e.git(repo, "commit", "-q", "-m", "x")
	second := decode[execJSON](t, e.mustNook(repo, "exec", "--no-sync", "--json", "--", "true").stdout).RunID
	if first != second {
		t.Fatalf("detached session not adopted: %s then %s", first, second)
	}
	lj := decode[listJSON](t, e.mustNook(repo, "list", "--json").stdout)
	if len(lj.Sessions) != 1 || !strings.HasPrefix(lj.Sessions[0].Branch, "detached@") {
		t.Fatalf("list = %+v", lj)
	}
}

func TestAdoptsRunWhoseLocalSessionWasLost(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	d := e.startDaemon()
	repo := e.newRepo("adopt", defaultConfig)
	run := e.startSandbox(repo)
	d.stop(t)
	db := filepath.Join(e.get("XDG_STATE_HOME"), "sandboxd", "sandboxd.db")
	if err := os.Remove(db); err != nil {
		t.Fatal(err)
	}
	e.startDaemon()
	ej := decode[execJSON](t, e.mustNook(repo, "exec", "--no-sync", "--json", "--", "true").stdout)
	if ej.RunID != run {
		t.Fatalf("the lost session's run %s was not adopted; exec used %s", run, ej.RunID)
	}
}

func TestStopOfProvisioningRunCancelsIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	slow := "tasks:\n  - key: setup\n    run: sleep 30\n  - key: sandbox\n    use: setup\n    run: rwx-sandbox\n"
	repo := e.newRepo("slow", slow)
	st := decode[startJSON](t, e.mustNook(repo, "start", "--json").stdout)
	if st.Session.Status != "provisioning" {
		t.Fatalf("start without --wait on a slow setup: %+v", st)
	}
	e.mustNook(repo, "stop")
	all := decode[listJSON](t, e.mustNook(repo, "list", "--all", "--json").stdout)
	if len(all.Sessions) != 1 || all.Sessions[0].Status != "stopped" {
		t.Fatalf("after stop: %+v", all)
	}
	// The remote no longer lists it as a sandbox either.
	if lj := decode[listJSON](t, e.mustNook(repo, "list", "--json").stdout); len(lj.Sessions) != 0 {
		t.Fatalf("still listed: %+v", lj)
	}
}

func TestResetReplacesTheSandbox(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("reset", defaultConfig)
	old := e.startSandbox(repo)
	r := e.mustNook(repo, "reset", "--wait", "--json")
	st := decode[startJSON](t, r.stdout)
	if st.Session.RunID == "" || st.Session.RunID == old {
		t.Fatalf("reset kept the old run: %s", r)
	}
	all := decode[listJSON](t, e.mustNook(repo, "list", "--all", "--json").stdout)
	states := map[string]string{}
	for _, s := range all.Sessions {
		states[s.RunID] = s.Status
	}
	if states[old] != "stopped" || states[st.Session.RunID] != "ready" {
		t.Fatalf("after reset: %v", states)
	}
}

func TestInitWritesTemplateOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("init", defaultConfig)
	os.Remove(filepath.Join(repo, ".rwx", "sandbox.yml"))
	e.mustNook(repo, "init")
	if !strings.Contains(readFile(t, filepath.Join(repo, ".rwx", "sandbox.yml")), "rwx-sandbox") {
		t.Fatal("template lacks the sandbox task")
	}
	if r := e.nook(repo, "init"); r.code == 0 || !strings.Contains(r.stderr, "already exists") {
		t.Fatalf("init over an existing file: %s", r)
	}
}

func TestSocketAPIRejectsBadInput(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("bad", defaultConfig)
	cases := []struct {
		name, method, path string
		body               any
		want               int
	}{
		{"unknown session", "GET", "/v1/sessions/nope/probe", nil, 404},
		{"empty argv", "POST", "/v1/exec", map[string]any{"cwd": repo, "argv": []string{}}, 400},
		{"relative cwd", "POST", "/v1/exec", map[string]any{"cwd": "relative/dir", "argv": []string{"true"}}, 400},
		{"nonexistent cwd", "POST", "/v1/exec", map[string]any{"cwd": "/does/not/exist", "argv": []string{"true"}}, 400},
		{"config outside the repository", "POST", "/v1/sessions/start", map[string]any{"cwd": repo, "configFile": "/etc/passwd"}, 400},
		{"directory as the config", "POST", "/v1/sessions/start", map[string]any{"cwd": repo, "configFile": ".rwx"}, 400},
		{"init outside the repository", "POST", "/v1/init", map[string]any{"cwd": repo, "file": "../../x.yml"}, 400},
		{"init into .git", "POST", "/v1/init", map[string]any{"cwd": repo, "file": ".git/hooks/pre-commit"}, 400},
		{"init through a link out of the repository", "POST", "/v1/init", map[string]any{"cwd": repo, "file": "out/x.yml"}, 400},
	}
	must(t, os.Symlink(e.root, filepath.Join(repo, "out")))
	for _, c := range cases {
		body, err := e.api(c.method, c.path, c.body)
		var se *statusError
		if !errors.As(err, &se) || se.code != c.want {
			t.Errorf("%s: got %v %s, want %d", c.name, err, body, c.want)
			continue
		}
		var eb struct {
			Error struct{ Code, Message string } `json:"error"`
		}
		if json.Unmarshal([]byte(se.body), &eb) != nil || eb.Error.Message == "" {
			t.Errorf("%s: error body %q lacks a message", c.name, se.body)
		}
	}
	for _, p := range []string{filepath.Join(e.root, "x.yml"), filepath.Join(repo, ".git", "hooks", "pre-commit"), filepath.Join(e.root, "x.yml")} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("init wrote %s", p)
		}
	}
}

// waitUntil polls cond until it holds or the timeout passes.
func waitUntil(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if cond() {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("timed out waiting for %s", what)
}

// TestLegacyImport: a session recorded by the RWX CLI in
// .rwx/sandboxes/sandboxes.json is imported the first time the repository is
// seen, and its run is used (the remote confirms that its cli_state names
// this checkout, branch and config: a run of another branch is refused, see
// TestForeignRunInTheCLIFileIsNotAdopted).
func TestLegacyImport(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	d := e.startDaemon()
	repo := e.newRepo("legacy", defaultConfig)
	run := e.startSandbox(repo)
	d.stop(t)
	os.Remove(filepath.Join(e.get("XDG_STATE_HOME"), "sandboxd", "sandboxd.db"))
	cfg := filepath.Join(repo, ".rwx", "sandbox.yml")
	legacy := `{"version":1,"sandboxes":{"main:` + cfg + `":{"runId":"` + run + `","configFile":"` + cfg + `"}}}`
	writeFile(t, filepath.Join(repo, ".rwx", "sandboxes", "sandboxes.json"), legacy)
	e.startDaemon()
	ej := decode[execJSON](t, e.mustNook(repo, "exec", "--no-sync", "--json", "--", "true").stdout)
	if ej.RunID != run {
		t.Fatalf("the legacy session's run %s was not used; exec ran in %s", run, ej.RunID)
	}
}

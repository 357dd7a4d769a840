package e2e

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// rwxVars are the daemon's environment for the RWX path: remote "rwx"
// pointed at lc, which behaves as RWX Cloud (runs API, agent, managed
// processes), its certificate trusted.
func (e *env) rwxVars(lc *localcloud) []string {
	e.t.Helper()
	st := exec.Command(filepath.Join(binDir, "sandboxd-localcloud"), "status", "--json")
	st.Env = e.vars
	out, err := st.Output()
	if err != nil {
		e.t.Fatal(err)
	}
	var d struct {
		CertFile string `json:"cert_file"`
	}
	if err := json.Unmarshal(out, &d); err != nil || d.CertFile == "" {
		e.t.Fatalf("localcloud status: %v %s", err, out)
	}
	return []string{"SANDBOXD_REMOTE=rwx", "RWX_HOST=" + lc.apiURL, "RWX_ACCESS_TOKEN=" + lc.token, "SSL_CERT_FILE=" + d.CertFile}
}

// runDir is run's directory in the localcloud of e (its workspace and
// run.log).
func (e *env) runDir(run string) string {
	data := e.get("XDG_DATA_HOME")
	if data == "" {
		data = filepath.Join(e.get("HOME"), ".local", "share")
	}
	return filepath.Join(data, "sandboxd", "localcloud", "runs", run)
}

type agentRecord struct {
	Key    string `json:"key"`
	Status string `json:"status"`
	PID    int    `json:"pid"`
}

// agentProcesses is the agent's list of run's managed processes, asked as
// `rwx sandbox background list` does, by key.
func (lc *localcloud) agentProcesses(t *testing.T, run string) map[string]agentRecord {
	t.Helper()
	c := lc.sshTo(t, run)
	s, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	out, err := s.Output("__rwx_sandbox_process_list__")
	if err != nil {
		t.Fatalf("list the managed processes: %v", err)
	}
	var list struct {
		Processes []agentRecord `json:"processes"`
	}
	if err := json.Unmarshal(out, &list); err != nil {
		t.Fatalf("the process list %q: %v", out, err)
	}
	recs := map[string]agentRecord{}
	for _, r := range list.Processes {
		recs[r.Key] = r
	}
	return recs
}

// nativeExec runs a synced exec that edits a file and reports whether it
// was the helper's native exchange (which writes its messages to
// .git/sandboxd/native.err, left empty when nothing declined).
func (e *env) nativeExec(t *testing.T, repo, run, content string) bool {
	t.Helper()
	mark := filepath.Join(e.runDir(run), "workspace", ".git", "sandboxd", "native.err")
	_ = os.Remove(mark)
	writeFile(t, filepath.Join(repo, "a.txt"), content)
	r := e.mustNook(repo, "exec", "--", "sh", "-c", "cat a.txt; echo made > made.txt")
	if r.stdout != content {
		t.Fatalf("the sandbox saw %q, want %q", r.stdout, content)
	}
	if got := readFile(t, filepath.Join(repo, "made.txt")); got != "made\n" {
		t.Fatalf("the command's edit came back as %q", got)
	}
	fi, err := os.Stat(mark)
	return err == nil && fi.Size() == 0
}

// TestRWXPathRunsTheHelperAsAManagedProcess: with remote "rwx" (localcloud
// behaving as RWX Cloud), the sandbox helper starts by default as the
// agent's managed process "sandboxd-helper", shows in the agent's process
// list, serves synced execs natively, survives the connections that
// started it (the same process after they drop, and found again by a
// restarted daemon), says it serves in doctor,
// and is stopped with the process directive when the session ends.
func TestRWXPathRunsTheHelperAsAManagedProcess(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	d := e.startDaemon(e.rwxVars(lc)...)
	repo := e.newRepo("rwxhelper", defaultConfig)
	run := e.startServedSandbox(t, repo)

	recs := lc.agentProcesses(t, run)
	h, ok := recs["sandboxd-helper"]
	if !ok || h.Status != "running" || h.PID == 0 {
		t.Fatalf("the agent's process list has no running sandboxd-helper: %+v", recs)
	}
	if list := e.mustNook(repo, "bg", "list", "--json"); strings.Contains(list.stdout, "sandboxd-helper") {
		t.Errorf("nook bg list shows sandboxd's own helper as a background process: %s", list.stdout)
	}
	waitUntil(t, 20*time.Second, "a native synced exec", func() bool { return e.nativeExec(t, repo, run, "one\n") })

	// Every connection to the agent drops: the helper stays, and the
	// next connection uses it (no second start).
	lc.call(t, "POST", "/admin/runs/"+run+"/drop-connections", nil)
	if !e.nativeExec(t, repo, run, "two\n") {
		t.Fatal("after the connections dropped, the synced exec did not take the helper's native way")
	}
	if got := lc.agentProcesses(t, run)["sandboxd-helper"]; got.PID != h.PID || got.Status != "running" {
		t.Fatalf("after the connections dropped the helper is %+v, want the same process %d running", got, h.PID)
	}
	// A new daemon (no memory of it) finds the same server through ping
	// rather than starting another.
	d.stop(t)
	e.startDaemon(e.rwxVars(lc)...)
	waitUntil(t, 20*time.Second, "a native synced exec after the daemon's restart", func() bool { return e.nativeExec(t, repo, run, "three\n") })
	if got := lc.agentProcesses(t, run)["sandboxd-helper"]; got.PID != h.PID || got.Status != "running" {
		t.Fatalf("after the daemon's restart the helper is %+v, want the same process %d running", got, h.PID)
	}
	if doc := e.nook(repo, "doctor"); !strings.Contains(doc.stdout+doc.stderr, "helper "+run) || !strings.Contains(doc.stdout+doc.stderr, "serving") {
		t.Errorf("doctor does not say the helper serves:\n%s", doc)
	}

	e.mustNook(repo, "stop")
	log := readFile(t, filepath.Join(e.runDir(run), "run.log"))
	if !strings.Contains(log, "background sandboxd-helper stopped") {
		t.Fatalf("the session's end did not stop the helper with the stop directive; run log:\n%s", log)
	}
}

// TestRWXPathHelperThatCannotStartFallsBackSayingSoOnce: a helper that
// installs but never serves (its server exits at once) leaves synced
// execs to the scripts, which stay correct; the fallback is said once,
// as a helper.fallback event, and doctor names it.
func TestRWXPathHelperThatCannotStartFallsBackSayingSoOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	broken := filepath.Join(e.root, "broken-helper")
	writeFile(t, broken, `#!/bin/sh
case "$1" in
version) echo "sandboxd-helper $(sha256sum "$0" | cut -d' ' -f1)" ;;
ping) exit 4 ;;
*) echo "this helper serves nothing" >&2; exit 1 ;;
esac
`)
	if err := os.Chmod(broken, 0o755); err != nil {
		t.Fatal(err)
	}
	e.writeConfig(map[string]any{"sync_helper": broken})
	e.startDaemon(e.rwxVars(lc)...)
	repo := e.newRepo("rwxbroken", defaultConfig)
	events := e.followEvents("")
	run := e.startSandbox(repo)
	e.mustNook(repo, "exec", "--", "true")
	ev := events.waitFor(t, time.Minute, "helper.fallback", eventType("helper.fallback"))
	if ev["runId"] != run || !strings.Contains(string(mustJSON(t, ev["data"])), "did not answer") {
		t.Errorf("the fallback event: %v", ev)
	}
	for i := range 3 {
		want := strings.Repeat("x", i+1) + "\n"
		writeFile(t, filepath.Join(repo, "a.txt"), want)
		if r := e.mustNook(repo, "exec", "--", "cat", "a.txt"); r.stdout != want || strings.Contains(r.stderr, "helper") {
			t.Fatalf("synced exec without the helper: %s", r)
		}
	}
	doc := e.nook(repo, "doctor")
	if !strings.Contains(doc.stdout+doc.stderr, "helper "+run) || !strings.Contains(doc.stdout+doc.stderr, "not running") {
		t.Errorf("doctor does not say the helper is not running:\n%s", doc)
	}
	// No second fallback event for the run.
	more := 0
	deadline := time.After(500 * time.Millisecond)
	for done := false; !done; {
		select {
		case ev := <-events.ch:
			if ev["type"] == "helper.fallback" {
				more++
			}
		case <-deadline:
			done = true
		}
	}
	if more != 0 {
		t.Fatalf("the fallback was said %d more times", more)
	}
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// helperServing reports whether doctor says the daemon's sandbox helper
// serves in run's sandbox (any sandbox's when run is "").
func (e *env) helperServing(run string) bool {
	r := e.nook(e.root, "doctor")
	for _, line := range strings.Split(r.stdout+r.stderr, "\n") {
		if strings.Contains(line, "helper "+run) && strings.Contains(line, "serving (") {
			return true
		}
	}
	return false
}

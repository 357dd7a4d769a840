package e2e

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
)

// TestConfiglessCommandsFindTheBranchSandbox: exec, status, stop and reset
// without a config act on the branch's one live sandbox whatever config
// started it (as the RWX CLI's do); with two live sandboxes they list both
// and ask for a choice; with none, .rwx/sandbox.yml is the one created.
func TestConfiglessCommandsFindTheBranchSandbox(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("branchbox", defaultConfig)
	other := filepath.Join(repo, ".rwx", "other.yml")
	writeFile(t, other, defaultConfig)
	run := decode[startJSON](t, e.mustNook(repo, "start", "--wait", "--json", ".rwx/other.yml").stdout).Session.RunID

	if r := e.mustNook(repo, "exec", "--", "true"); e.liveRuns(repo) != 1 {
		t.Fatalf("a config-less exec started a second sandbox beside %s: %s", run, r)
	}
	var st struct {
		Session struct {
			RunID string `json:"runId"`
		} `json:"session"`
	}
	if err := json.Unmarshal([]byte(e.mustNook(repo, "status", "--json").stdout), &st); err != nil || st.Session.RunID != run {
		t.Fatalf("config-less status does not report %s: %+v %v", run, st, err)
	}
	var reset struct {
		RunID      string `json:"runId"`
		ConfigFile string `json:"configFile"`
	}
	if err := json.Unmarshal([]byte(e.mustNook(repo, "reset", "--json").stdout), &struct {
		Session any `json:"session"`
	}{&reset}); err != nil || reset.RunID == run || reset.ConfigFile != other {
		t.Fatalf("config-less reset did not replace the branch's sandbox of %s with one of the same config: %+v", other, reset)
	}
	run = reset.RunID

	// A second live sandbox on the branch: a choice, listing both.
	def := e.startSandbox(repo)
	for _, args := range [][]string{{"exec", "--", "true"}, {"stop"}, {"status"}} {
		r := e.nook(repo, args...)
		if r.code == 0 || !strings.Contains(r.stderr, run) || !strings.Contains(r.stderr, def) || !strings.Contains(r.stderr, "other.yml") {
			t.Fatalf("nook %v with two live sandboxes on the branch: %s, want a refusal listing both", args, r)
		}
	}
	e.mustNook(repo, "stop", ".rwx/sandbox.yml")
	if r := e.mustNook(repo, "stop"); !strings.Contains(r.stdout+r.stderr, run) {
		t.Fatalf("config-less stop did not stop %s: %s", run, r)
	}
	if n := e.liveRuns(repo); n != 0 {
		t.Fatalf("%d sandboxes still live after stopping both", n)
	}
}

// liveRuns counts the live sessions of repo.
func (e *env) liveRuns(repo string) int {
	e.t.Helper()
	var l struct {
		Sessions []struct {
			RepoRoot string `json:"repoRoot"`
			Status   string `json:"status"`
		} `json:"sessions"`
	}
	if err := json.Unmarshal([]byte(e.mustNook(repo, "list", "--json").stdout), &l); err != nil {
		e.t.Fatal(err)
	}
	n := 0
	for _, s := range l.Sessions {
		if s.RepoRoot == repo {
			n++
		}
	}
	return n
}

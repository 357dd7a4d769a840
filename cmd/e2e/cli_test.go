package e2e

import (
	"bufio"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestCLIEdges: the rough edges a new user met (issue 13), each against the
// real daemon and the local remote.
func TestCLIEdges(t *testing.T) {
	e := newEnv(t)
	d := e.startDaemon()
	repo := e.newRepo("edges", defaultConfig)
	outside := filepath.Join(e.root, "not-a-repo")
	if err := os.MkdirAll(outside, 0o755); err != nil {
		t.Fatal(err)
	}

	// A second sandboxd names itself once.
	cmd := exec.Command(filepath.Join(binDir, "sandboxd"))
	cmd.Env = e.vars
	out, _ := cmd.CombinedOutput()
	if !strings.Contains(string(out), "sandboxd is already running") || strings.Contains(string(out), "sandboxd: sandboxd") {
		t.Errorf("second sandboxd: %s", out)
	}

	// No sandbox yet: status answers no_sandbox and exits 0.
	r := e.mustSbx(repo, "status", "--json")
	if st := decode[struct{ Probe string }](t, r.stdout); st.Probe != "no_sandbox" {
		t.Errorf("status without a sandbox: %s", r)
	}
	if r := e.mustSbx(repo, "status"); !strings.Contains(r.stdout, "no_sandbox") {
		t.Errorf("status without a sandbox: %s", r)
	}

	// init outside a repository writes nothing.
	if r := e.sbx(outside, "init"); r.code != 125 || !strings.Contains(r.stderr, "not inside a git repository") {
		t.Errorf("init outside a repository: %s", r)
	}
	if _, err := os.Stat(filepath.Join(outside, ".rwx")); !os.IsNotExist(err) {
		t.Errorf("init outside a repository wrote %s/.rwx (%v)", outside, err)
	}
	// reset outside a repository does not suggest the --id it lacks.
	if r := e.sbx(outside, "reset"); r.code != 125 || strings.Contains(r.stderr, "--id") || !strings.Contains(r.stderr, "not inside a git repository") {
		t.Errorf("reset outside a repository: %s", r)
	}
	if r := e.sbx(outside, "status"); r.code != 125 || !strings.Contains(r.stderr, "--id") {
		t.Errorf("status outside a repository should offer --id: %s", r)
	}
	// stop --id of an unknown run fails and says so; under --json as an
	// error object on stdout, with nothing on stderr.
	if r := e.sbx(repo, "stop", "--id", "nope"); r.code != 125 || !strings.Contains(r.stderr, "run nope is unknown") {
		t.Errorf("stop --id nope: %s", r)
	}
	r = e.sbx(repo, "stop", "--id", "nope", "--json")
	ej := decode[struct{ Type, Code, Message, Hint string }](t, r.stdout)
	if r.code != 125 || r.stderr != "" || ej.Type != "error" || ej.Code != "not_found" || !strings.Contains(ej.Message, "nope") || !strings.Contains(ej.Hint, "sbx list --all") {
		t.Errorf("stop --id nope --json: %s", r)
	}
	// Usage errors too.
	r = e.sbx(repo, "exec", "--json", "--bogus", "--", "true")
	if ej := decode[struct{ Code, Hint string }](t, r.stdout); r.code != 125 || ej.Code != "usage" || !strings.Contains(ej.Hint, "sbx exec") {
		t.Errorf("usage error under --json: %s", r)
	}

	// exec --json: stdout is NDJSON records only, output then the result.
	r = e.sbx(repo, "exec", "--json", "--", "sh", "-c", "echo out; echo err >&2; printf 'caf\\303\\251'; exit 3")
	if r.code != 3 {
		t.Fatalf("exec --json: %s", r)
	}
	var streams []string
	var text strings.Builder
	var last map[string]any
	sc := bufio.NewScanner(strings.NewReader(r.stdout))
	for sc.Scan() {
		var rec map[string]any
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			t.Fatalf("exec --json stdout line %q is not JSON: %v\n%s", sc.Text(), err, r)
		}
		if rec["type"] == "output" {
			streams = append(streams, rec["stream"].(string))
			if rec["stream"] == "stdout" {
				text.WriteString(rec["text"].(string))
			}
		}
		last = rec
	}
	if last["type"] != "result" || last["exitCode"] != float64(3) || text.String() != "out\ncafé" || !strings.Contains(strings.Join(streams, ","), "stderr") {
		t.Errorf("exec --json records: %s", r)
	}

	// The drift warning: worded alike by exec and status, and printed by
	// exec once per change of the config.
	events := e.followEvents("")
	writeFile(t, filepath.Join(repo, ".rwx", "sandbox.yml"), defaultConfig+"# changed\n")
	events.waitFor(t, 20*time.Second, "config.drift", eventType("config.drift"))
	first := e.mustSbx(repo, "exec", "--", "true")
	second := e.mustSbx(repo, "exec", "--", "true")
	status := e.mustSbx(repo, "status")
	const drift = "changed since this sandbox started: run `sbx reset` to start a sandbox with the new config"
	if strings.Count(first.stderr, drift) != 1 || strings.Contains(second.stderr, drift) || strings.Count(status.stderr, drift) != 1 {
		t.Errorf("drift warning: first exec %q, second exec %q, status %q", first.stderr, second.stderr, status.stderr)
	}
	writeFile(t, filepath.Join(repo, ".rwx", "sandbox.yml"), defaultConfig+"# changed again\n")
	events.waitFor(t, 20*time.Second, "config.drift", eventType("config.drift"))
	if r := e.mustSbx(repo, "exec", "--", "true"); strings.Count(r.stderr, drift) != 1 {
		t.Errorf("a second change of the config is not warned about: %q", r.stderr)
	}
	d.stop(t)
}

package e2e

import (
	"bufio"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestCLIEdges: the rough edges a new user met (issue 13), each against the
// real daemon and the local remote.
func TestCLIEdges(t *testing.T) {
	t.Parallel()
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
	r := e.mustNook(repo, "status", "--json")
	if st := decode[struct{ Probe string }](t, r.stdout); st.Probe != "no_sandbox" {
		t.Errorf("status without a sandbox: %s", r)
	}
	if r := e.mustNook(repo, "status"); !strings.Contains(r.stdout, "no_sandbox") {
		t.Errorf("status without a sandbox: %s", r)
	}

	// init outside a repository writes nothing.
	if r := e.nook(outside, "init"); r.code != 125 || !strings.Contains(r.stderr, "not inside a git repository") {
		t.Errorf("init outside a repository: %s", r)
	}
	if _, err := os.Stat(filepath.Join(outside, ".rwx")); !os.IsNotExist(err) {
		t.Errorf("init outside a repository wrote %s/.rwx (%v)", outside, err)
	}
	// reset outside a repository does not suggest the --id it lacks.
	if r := e.nook(outside, "reset"); r.code != 125 || strings.Contains(r.stderr, "--id") || !strings.Contains(r.stderr, "not inside a git repository") {
		t.Errorf("reset outside a repository: %s", r)
	}
	if r := e.nook(outside, "status"); r.code != 125 || !strings.Contains(r.stderr, "--id") {
		t.Errorf("status outside a repository should offer --id: %s", r)
	}
	// stop --id of an unknown run fails and says so; under --json as an
	// error object on stdout, with nothing on stderr.
	if r := e.nook(repo, "stop", "--id", "nope"); r.code != 125 || !strings.Contains(r.stderr, "run nope is unknown") {
		t.Errorf("stop --id nope: %s", r)
	}
	r = e.nook(repo, "stop", "--id", "nope", "--json")
	ej := decode[struct{ Type, Code, Message, Hint string }](t, r.stdout)
	if r.code != 125 || r.stderr != "" || ej.Type != "error" || ej.Code != "not_found" || !strings.Contains(ej.Message, "nope") || !strings.Contains(ej.Hint, "nook list --all") {
		t.Errorf("stop --id nope --json: %s", r)
	}
	// Usage errors too.
	r = e.nook(repo, "exec", "--json", "--bogus", "--", "true")
	if ej := decode[struct{ Code, Hint string }](t, r.stdout); r.code != 125 || ej.Code != "usage" || !strings.Contains(ej.Hint, "nook exec") {
		t.Errorf("usage error under --json: %s", r)
	}

	// exec --json: stdout is NDJSON records only, output then the result.
	r = e.nook(repo, "exec", "--json", "--", "sh", "-c", "echo out; echo err >&2; printf 'caf\\303\\251'; exit 3")
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
	first := e.mustNook(repo, "exec", "--", "true")
	second := e.mustNook(repo, "exec", "--", "true")
	status := e.mustNook(repo, "status")
	const drift = "changed since this sandbox started: run `nook reset` to start a sandbox with the new config"
	if strings.Count(first.stderr, drift) != 1 || strings.Contains(second.stderr, drift) || strings.Count(status.stderr, drift) != 1 {
		t.Errorf("drift warning: first exec %q, second exec %q, status %q", first.stderr, second.stderr, status.stderr)
	}
	writeFile(t, filepath.Join(repo, ".rwx", "sandbox.yml"), defaultConfig+"# changed again\n")
	events.waitFor(t, 20*time.Second, "config.drift", eventType("config.drift"))
	if r := e.mustNook(repo, "exec", "--", "true"); strings.Count(r.stderr, drift) != 1 {
		t.Errorf("a second change of the config is not warned about: %q", r.stderr)
	}
	d.stop(t)
}

// TestProgressPhases: while a sandbox starts, nook reports each phase on
// stderr (plain timestamped lines when stderr is not a terminal), nothing
// with --quiet, and `nook events` carries the same phases.
func TestProgressPhases(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	gate := filepath.Join(e.root, "gate")
	config := "tasks:\n  - key: deps\n    run: while [ ! -e " + gate + " ]; do sleep 0.05; done\n  - key: sandbox\n    run: rwx-sandbox\n"
	repo := e.newRepo("progress", config)
	events := e.followEvents("")

	cmd := e.nookCmd(repo, "start", "--wait")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// The setup step holds provisioning until the test has seen it.
	events.waitFor(t, 60*time.Second, "progress of the setup step", func(ev map[string]any) bool {
		d, _ := ev["data"].(map[string]any)
		return ev["type"] == "session.progress" && d["phase"] == "provisioning" && d["message"] == "setup step deps (1/1)"
	})
	writeFile(t, gate, "")
	if err := cmd.Wait(); err != nil {
		t.Fatalf("start --wait: %v\n%s", err, stderr.String())
	}
	// nook events carries every phase, up to ready.
	for _, phase := range []string{"connecting", "ready"} {
		events.waitFor(t, 20*time.Second, phase, func(ev map[string]any) bool {
			d, _ := ev["data"].(map[string]any)
			return ev["type"] == "session.progress" && d["phase"] == phase
		})
	}
	// On stderr, the phases up to provisioning (the last ones race with the
	// answer that ends the wait, by design: nook does not linger for them).
	lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
	want := []string{"creating the sandbox run", "run created", "provisioning: setup step deps (1/1)"}
	i := 0
	for _, l := range lines {
		if i < len(want) && strings.Contains(l, want[i]) {
			if !regexp.MustCompile(`^nook: \d\d:\d\d:\d\d `).MatchString(l) {
				t.Errorf("progress line without a timestamp: %q", l)
			}
			i++
		}
	}
	if i != len(want) {
		t.Fatalf("progress on stderr lacks %q (in order):\n%s", want[i:], stderr.String())
	}

	// --quiet: nothing on stderr, while a reset goes through the same phases.
	writeFile(t, gate, "")
	r := e.mustNook(repo, "reset", "--wait", "--quiet")
	if r.stderr != "" {
		t.Errorf("reset --quiet printed: %q", r.stderr)
	}
}

// TestDoctor: each check reports, with the fix when it fails; without a
// daemon it says so (and does not start one), exit 1.
func TestDoctor(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.nook(e.root, "doctor", "--json")
	type doctorOut struct {
		OK     bool
		Checks []struct {
			Name, Detail, Fix string
			OK                bool
		}
	}
	d := decode[doctorOut](t, r.stdout)
	if r.code != 1 || d.OK || len(d.Checks) == 0 || d.Checks[1].Name != "daemon" || d.Checks[1].OK || d.Checks[1].Fix == "" {
		t.Fatalf("doctor without a daemon: %s", r)
	}
	if _, err := os.Stat(e.socket()); err == nil {
		t.Fatal("doctor started a daemon")
	}
	e.startDaemon()
	repo := e.newRepo("doctor", defaultConfig)
	run := e.startSandbox(repo)
	r = e.nook(repo, "doctor", "--json")
	d = decode[doctorOut](t, r.stdout)
	names := map[string]bool{}
	for _, c := range d.Checks {
		names[c.Name] = c.OK
	}
	for _, want := range []string{"socket", "daemon", "git", "watches", "remote", "ssh " + run, "clock " + run} {
		// The watch limits are this machine's: only their check must be there.
		if ok, found := names[want]; !found || !ok && want != "watches" {
			t.Errorf("check %q: found %v ok %v\n%s", want, found, ok, r)
		}
	}
	if wantCode := map[bool]int{true: 0, false: 1}[names["watches"]]; r.code != wantCode || d.OK != names["watches"] {
		t.Errorf("doctor: %s", r)
	}
	if r := e.nook(repo, "doctor"); !strings.Contains(r.stdout, "ok  ") || !strings.Contains(r.stdout, "ssh "+run) {
		t.Errorf("doctor (text): %s", r)
	}
}

// TestReadmeTour runs the README's two-minute tour as a newcomer pastes it
// (with the harness's binaries instead of `make build`), so that it keeps
// working as the commands change.
func TestReadmeTour(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	readme := readFile(t, filepath.Join("..", "..", "README.md"))
	i := strings.Index(readme, "## A first sandbox in two minutes")
	if i < 0 {
		t.Fatal("the README has no two-minute tour")
	}
	block := readme[i:]
	block = block[strings.Index(block, "```sh\n")+len("```sh\n"):]
	block = block[:strings.Index(block, "```")]
	const build = `make build && export PATH="$PWD/bin:$PATH"`
	if !strings.HasPrefix(block, build) {
		t.Fatalf("the tour does not start with %q:\n%s", build, block)
	}
	tour := filepath.Join(e.root, "tour")
	script := strings.ReplaceAll(strings.Replace(block, build, "true", 1), "/tmp/nook-tour", tour)
	t.Cleanup(func() {
		// The tour stops what it starts; after a failure, stop the
		// autostarted daemon (not a child of the test) by its pid.
		if b, err := os.ReadFile(filepath.Join(e.get("XDG_STATE_HOME"), "sandboxd", "sandboxd.pid")); err == nil {
			if pid, err := strconv.Atoi(strings.SplitN(string(b), "\n", 2)[0]); err == nil && pid > 0 {
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	})
	// As pasted: no -e (nook doctor exits 1 on a machine whose watch limits
	// are low); the output says whether each step worked.
	cmd := exec.Command("bash", "-c", script)
	cmd.Dir = e.root
	cmd.Env = e.with("SANDBOXD_NO_AUTOSTART=")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the tour failed: %v\n%s", err, out)
	}
	for _, want := range []string{"hello\n", "edited\n", "connected", `"type":"result"`, "sandboxd stopped", "stopped sandboxd-localcloud"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("the tour's output lacks %q:\n%s", want, out)
		}
	}
	if !regexp.MustCompile(`(?m)^ok +daemon`).Match(out) || strings.Contains(string(out), "command not found") {
		t.Errorf("the tour's output:\n%s", out)
	}
}

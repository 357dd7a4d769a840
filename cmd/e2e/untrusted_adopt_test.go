package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/rwxapi"
)

// TestForeignRunInTheCLIFileIsNotAdopted: a sandbox can write the RWX CLI's
// .rwx/sandboxes/sandboxes.json of the checkout (a pull brings it back, or
// the command writes it). Written as an attacker would, naming a run of
// another checkout (new key format) or of another branch (old
// cwd:branch:config format) with a scoped token, it is not adopted: the
// daemon says why, the user's next exec runs in a sandbox of its own, and
// the uncommitted file it syncs never reaches the foreign run. A run the
// CLI started for this checkout is still adopted.
func TestForeignRunInTheCLIFileIsNotAdopted(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	// The reconcile loop would adopt the foreign runs as what their
	// cli_state says (their own checkout, branch): that is right, but the
	// file's claim would then name a known run and prove nothing.
	e.writeConfig(map[string]any{"reconcile_interval": "1h"})
	e.startDaemon()
	cli := e.fakeCLI(lc)
	victim := e.newRepo("victim", defaultConfig)
	attacker := e.newRepo("attacker", defaultConfig)
	cfg := filepath.Join(victim, ".rwx", "sandbox.yml")

	// Runs the daemon does not know: one the RWX CLI started in another
	// checkout, one it started on another branch of this checkout.
	foreign := cliRun(t, cli, attacker, "main")
	e.git(victim, "checkout", "-q", "-b", "feature")
	otherBranch := cliRun(t, cli, victim, "feature")
	e.git(victim, "checkout", "-q", "main")

	cases := []struct {
		name, branch, run, file string
	}{
		{"another checkout's run under a branch:config key", "main", foreign,
			`{"version":1,"sandboxes":{"main:` + cfg + `":{"runId":"` + foreign + `","configFile":"` + cfg + `","scopedToken":"forged"}}}`},
		{"another branch's run under a cwd:branch:config key", "dev", otherBranch,
			`{"sandboxes":{"` + victim + `:dev:.rwx/sandbox.yml":{"runId":"` + otherBranch + `","configFile":".rwx/sandbox.yml","scopedToken":"forged"}}}`},
	}
	for _, c := range cases {
		if c.branch != "main" {
			e.git(victim, "checkout", "-q", "-b", c.branch)
		}
		events := e.followEvents("")
		// The daemon has seen the checkout: its watch reads the file.
		e.nook(victim, "status")
		writeFile(t, cliStoragePath(victim), c.file)
		secret := "secret-" + c.branch + ".env"
		writeFile(t, filepath.Join(victim, secret), "TOKEN=user-secret\n")
		ej := decode[execJSON](t, e.mustNook(victim, "exec", "--json", "--", "cat", secret).stdout)
		if ej.RunID == c.run || ej.RunID == foreign || ej.RunID == otherBranch {
			t.Fatalf("%s: the exec ran in the foreign run %s", c.name, ej.RunID)
		}
		// The foreign run never saw the file (looked at without syncing).
		e.mustNook(attacker, "start", "--wait", "--id", c.run)
		if r := e.nook(attacker, "exec", "--no-sync", "--id", c.run, "--", "sh", "-c", "test ! -e "+secret); r.code != 0 {
			t.Fatalf("%s: the foreign run %s holds %s: %s", c.name, c.run, secret, r)
		}
		ev := events.waitFor(t, 20*time.Second, "adoption refused", func(ev map[string]any) bool {
			return ev["type"] == "session.adoption_refused" && ev["runId"] == c.run
		})
		if data, _ := ev["data"].(map[string]any); data["reason"] == "" || data["reason"] == nil {
			t.Fatalf("%s: the refusal says no reason: %v", c.name, ev)
		}
		events.stop()
	}

	// The legitimate case still holds: a run the RWX CLI starts for this
	// checkout and branch, recorded in its file, is adopted and used.
	e.git(victim, "checkout", "-q", "-b", "legit")
	events := e.followEvents("")
	run, how := cli.execRun(victim)
	if how != "created" {
		t.Fatalf("the CLI found a sandbox (%s) for a new branch", how)
	}
	events.waitFor(t, 20*time.Second, "adoption of the CLI's run", func(ev map[string]any) bool {
		data, _ := ev["data"].(map[string]any)
		return ev["type"] == "session.adopted" && ev["runId"] == run && data["from"] == "rwx-cli"
	})
	if ej := decode[execJSON](t, e.mustNook(victim, "exec", "--no-sync", "--json", "--", "true").stdout); ej.RunID != run {
		t.Fatalf("nook exec ran in %s, want the CLI's run %s", ej.RunID, run)
	}
}

// cliRun starts a run of repo's branch as the RWX CLI does (cli_state with
// the absolute config path), without sandboxd.
func cliRun(t *testing.T, cli *fakeCLI, repo, branch string) string {
	t.Helper()
	cfg := filepath.Join(repo, ".rwx", "sandbox.yml")
	config := readFile(t, cfg)
	res, err := cli.api.CreateRun(context.Background(), rwxapi.RunDefinition{
		Title:           "Sandbox: " + filepath.Base(repo) + " (" + branch + ")",
		CLIState:        rwxapi.CLIState{Branch: branch, ConfigFile: cfg}.Encode(),
		Git:             rwxapi.GitMetadata{Branch: branch, Sha: cli.e.git(repo, "rev-parse", "HEAD"), OriginURL: repo},
		TaskDefinitions: []rwxapi.DirectoryEntry{{Path: ".rwx/sandbox.yml", Type: "file", Permissions: 0o644, FileContents: config}},
		MintDirectory:   []rwxapi.DirectoryEntry{{Path: "sandbox.yml", Type: "file", Permissions: 0o644, FileContents: config}},
		UseCache:        true,
	}, "")
	if err != nil {
		t.Fatal(err)
	}
	return res.RunID
}

// rawMCP is `nook mcp` driven line by line, as a broken or hostile client
// would.
type rawMCP struct {
	t       *testing.T
	in      io.WriteCloser
	answers chan map[string]any
	stderr  *bytes.Buffer
}

func (e *env) rawMCP(t *testing.T, dir string, args ...string) *rawMCP {
	t.Helper()
	cmd := e.nookCmd(dir, append([]string{"mcp"}, args...)...)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	m := &rawMCP{t: t, in: in, answers: make(chan map[string]any, 64), stderr: &bytes.Buffer{}}
	cmd.Stderr = m.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(m.answers)
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			var a map[string]any
			if err := json.Unmarshal(sc.Bytes(), &a); err != nil {
				t.Errorf("nook mcp wrote a line that is not JSON: %q", sc.Text())
				continue
			}
			m.answers <- a
		}
	}()
	t.Cleanup(func() {
		in.Close()
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
			t.Errorf("nook mcp did not end within 10s of its stdin closing")
		}
	})
	return m
}

func (m *rawMCP) send(line string) {
	m.t.Helper()
	if _, err := io.WriteString(m.in, line+"\n"); err != nil {
		m.t.Fatalf("write %q to nook mcp: %v (stderr: %s)", line, err, m.stderr)
	}
}

func (m *rawMCP) next(what string) map[string]any {
	m.t.Helper()
	select {
	case a, ok := <-m.answers:
		if !ok {
			m.t.Fatalf("nook mcp ended before answering %s; stderr: %s", what, m.stderr)
		}
		return a
	case <-time.After(60 * time.Second):
		m.t.Fatalf("nook mcp did not answer %s within 60s", what)
	}
	return nil
}

func errorCode(a map[string]any) float64 {
	e, _ := a["error"].(map[string]any)
	code, _ := e["code"].(float64)
	return code
}

// TestMCPSurvivesMalformedLinesAndStaysInItsCheckout: `nook mcp` answers a
// line that is not JSON with -32700 and one that is not a JSON-RPC message
// ([] among them) with -32600, and serves the requests after them; started
// in a checkout, it refuses a call naming another checkout (by cwd or by
// the runId of its sandbox) and serves its own.
func TestMCPSurvivesMalformedLinesAndStaysInItsCheckout(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	mine := e.newRepo("mine", defaultConfig)
	other := e.newRepo("other", defaultConfig)
	otherRun := e.startSandbox(other)
	m := e.rawMCP(t, mine)

	m.send(`{not json}`)
	if a := m.next("{not json}"); errorCode(a) != -32700 || a["id"] != nil {
		t.Fatalf("answer to {not json}: %v", a)
	}
	m.send(`[]`)
	if a := m.next("[]"); errorCode(a) != -32600 {
		t.Fatalf("answer to []: %v", a)
	}
	m.send(`{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"e2e","version":"1"}}}`)
	if a := m.next("initialize"); a["id"] != float64(1) || a["result"] == nil {
		t.Fatalf("initialize after malformed lines: %v", a)
	}
	m.send(`{"jsonrpc":"2.0","method":"notifications/initialized"}`)
	m.send(`{"jsonrpc":"2.0","id":"x","method":7}`)
	if a := m.next("a method that is a number"); errorCode(a) != -32600 || a["id"] != "x" {
		t.Fatalf("answer to a bad method: %v", a)
	}

	callTool := func(id int, args map[string]any) map[string]any {
		t.Helper()
		b, _ := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": map[string]any{"name": "status", "arguments": args}})
		m.send(string(b))
		a := m.next(fmt.Sprintf("status %v", args))
		if a["id"] != float64(id) {
			t.Fatalf("answer to call %d: %v", id, a)
		}
		res, _ := a["result"].(map[string]any)
		return res
	}
	for i, args := range []map[string]any{{"cwd": other}, {"runId": otherRun}} {
		res := callTool(10+i, args)
		raw, _ := json.Marshal(res)
		if res["isError"] != true || !strings.Contains(string(raw), "outside the checkout") {
			t.Fatalf("status %v from a server confined to %s: %s", args, mine, raw)
		}
	}
	if res := callTool(20, nil); res["isError"] == true {
		raw, _ := json.Marshal(res)
		t.Fatalf("status of the server's own checkout: %s", raw)
	}
}

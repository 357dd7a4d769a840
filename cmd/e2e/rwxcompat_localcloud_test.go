package e2e

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/rwxapi"
)

// cliConnInfo is the RWX CLI's api.SandboxConnectionInfo (rwx-cloud/rwx,
// 2026-08): what it reads of sandbox_connection_info.
type cliConnInfo struct {
	Sandboxable   bool   `json:"sandboxable"`
	FailureReason string `json:"failure_reason"`
	Polling       struct {
		Completed bool `json:"completed"`
		BackoffMs *int `json:"backoff_ms"`
	} `json:"polling"`
}

// cliRunStatus is its api.RunStatusResult (results/status).
type cliRunStatus struct {
	Status *struct {
		Result string `json:"result"`
	} `json:"run_status"`
	Polling struct {
		Completed bool `json:"completed"`
		BackoffMs *int `json:"backoff_ms"`
	} `json:"polling"`
}

// get is one GET of the RWX CLI: status and body.
func (lc *localcloud) get(t testing.TB, path, accept string) (int, []byte) {
	t.Helper()
	req, _ := http.NewRequest("GET", lc.apiURL+path, nil)
	req.Header.Set("Authorization", "Bearer "+lc.token)
	req.Header.Set("Accept", accept)
	resp, err := lc.client.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, b
}

// createCLIRun creates a sandbox run of repo's config as `rwx sandbox
// start` sends it.
func (e *env) createCLIRun(lc *localcloud, repo string) (string, error) {
	e.t.Helper()
	cli := e.fakeCLI(lc)
	cfg := readFile(e.t, filepath.Join(repo, ".rwx", "sandbox.yml"))
	res, err := cli.api.CreateRun(context.Background(), rwxapi.RunDefinition{
		Title:           "Sandbox: " + filepath.Base(repo),
		Git:             rwxapi.GitMetadata{Branch: "main", Sha: e.git(repo, "rev-parse", "HEAD"), OriginURL: repo},
		TaskDefinitions: []rwxapi.DirectoryEntry{{Path: ".rwx/sandbox.yml", Type: "file", Permissions: 0o644, FileContents: cfg}},
		MintDirectory:   []rwxapi.DirectoryEntry{{Path: "sandbox.yml", Type: "file", Permissions: 0o644, FileContents: cfg}},
		UseCache:        true,
	}, "")
	return res.RunID, err
}

// waitForSandbox is the CLI's waitForSandboxReadyWithToken: poll
// connection info (200 only) until sandboxable, or until completed or a
// failure reason ends the wait.
func (lc *localcloud) waitForSandbox(t testing.TB, run string) cliConnInfo {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		code, body := lc.get(t, "/mint/api/sandbox_connection_info?sandbox_key="+url.QueryEscape(run), "application/json")
		if code != http.StatusOK {
			t.Fatalf("connection info of run %s answered %d %s: the CLI stops waiting with an error here, never naming the failed task", run, code, body)
		}
		var ci cliConnInfo
		if err := json.Unmarshal(body, &ci); err != nil {
			t.Fatalf("connection info %s: %v", body, err)
		}
		if ci.Sandboxable || ci.Polling.Completed || ci.FailureReason != "" {
			return ci
		}
		if time.Now().After(deadline) {
			t.Fatalf("run %s neither sandboxable nor completed after 60s: %s", run, body)
		}
		backoff := 2000
		if ci.Polling.BackoffMs != nil {
			backoff = *ci.Polling.BackoffMs
		}
		time.Sleep(time.Duration(backoff) * time.Millisecond)
	}
}

// TestLocalcloudRunsCommandsBeforeRwxSandbox: a sandbox task whose `run:`
// has commands before rwx-sandbox (as RWX's own definitions do) is
// accepted; its commands run in the checkout before the sandbox is handed
// over. A script that goes on after rwx-sandbox is refused with a 400
// saying so.
func TestLocalcloudRunsCommandsBeforeRwxSandbox(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	repo := e.newRepo("runbefore", `tasks:
  - key: code
    call: git/clone 2.0.7
  - key: sandbox
    use: code
    run: |
      echo "setup-artifact-content" > setup-artifact.txt
      rwx-sandbox
`)
	run, err := e.createCLIRun(lc, repo)
	if err != nil {
		t.Fatalf("localcloud refused a sandbox task with commands before rwx-sandbox: %v", err)
	}
	if ci := lc.waitForSandbox(t, run); !ci.Sandboxable {
		t.Fatalf("run %s did not become sandboxable: %+v", run, ci)
	}
	if out := e.fakeCLI(lc).sshRun(lc, run, "cat setup-artifact.txt"); out != "setup-artifact-content\n" {
		t.Fatalf("the commands before rwx-sandbox did not run in the checkout: %q", out)
	}

	writeFile(t, filepath.Join(repo, ".rwx", "sandbox.yml"), "tasks:\n  - key: sandbox\n    run: |\n      rwx-sandbox\n      echo after\n")
	_, err = e.createCLIRun(lc, repo)
	if err == nil || !strings.Contains(err.Error(), "after `rwx-sandbox`") {
		t.Fatalf("a script going on after rwx-sandbox: %v, want a 400 saying so", err)
	}
}

// TestLocalcloudReportsFailedSetupAsTheRWXCLIReadsIt: a run whose setup
// step fails answers connection info 200 with polling.completed and
// failure_reason "failed" (not 410), results/status says it completed as
// failed, and results/prompt names the failed task with its output, which
// is what the CLI prints. A run that ended after it was sandboxable still
// answers 410.
func TestLocalcloudReportsFailedSetupAsTheRWXCLIReadsIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	repo := e.newRepo("setupfail", `tasks:
  - key: preflight
    run: |
      echo "intentional-setup-failure"
      exit 1
  - key: sandbox
    use: preflight
    run: rwx-sandbox
`)
	run, err := e.createCLIRun(lc, repo)
	if err != nil {
		t.Fatal(err)
	}
	ci := lc.waitForSandbox(t, run)
	if ci.Sandboxable || !ci.Polling.Completed || ci.FailureReason != "failed" {
		t.Fatalf("connection info of a failed setup: %+v, want completed, not sandboxable, failure_reason failed", ci)
	}
	code, body := lc.get(t, "/mint/api/results/status?id="+run+"&fail_fast=false", "application/json")
	var st cliRunStatus
	if code != http.StatusOK || json.Unmarshal(body, &st) != nil || !st.Polling.Completed || st.Status == nil || st.Status.Result != "failed" {
		t.Fatalf("results/status of the failed run: %d %s", code, body)
	}
	code, body = lc.get(t, "/mint/api/results/prompt?id="+run, "text/plain")
	prompt := string(body)
	if code != http.StatusOK || !strings.Contains(prompt, "Failed task") || !strings.Contains(prompt, "preflight") || !strings.Contains(prompt, "intentional-setup-failure") {
		t.Fatalf("results/prompt must name the failed task and show its output: %d\n%s", code, prompt)
	}

	// Ended after it was a sandbox: 410, as before.
	ok := e.newRepo("setupok", defaultConfig)
	run, err = e.createCLIRun(lc, ok)
	if err != nil {
		t.Fatal(err)
	}
	if ci := lc.waitForSandbox(t, run); !ci.Sandboxable {
		t.Fatalf("run %s did not become sandboxable: %+v", run, ci)
	}
	lc.call(t, "POST", "/mint/api/runs/"+run+"/cancel", nil)
	if code, body := lc.get(t, "/mint/api/sandbox_connection_info?sandbox_key="+run, "application/json"); code != http.StatusGone {
		t.Fatalf("connection info of an ended sandbox: %d %s, want 410", code, body)
	}
}

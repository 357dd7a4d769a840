package e2e

import (
	"encoding/json"
	"strings"
	"testing"
)

// cliProcess is what the RWX CLI reads of a process directive's answer.
type cliProcess struct {
	Key        string `json:"key"`
	Status     string `json:"status"`
	StdoutPath string `json:"stdoutPath"`
	StderrPath string `json:"stderrPath"`
}

// cliDirective sends a managed-process directive as `rwx sandbox
// background` does (the directive, a space, the JSON request) and decodes
// the record.
func (c *fakeCLI) cliDirective(lc *localcloud, run, directive string, req any) cliProcess {
	c.t.Helper()
	b, _ := json.Marshal(req)
	out := c.sshRun(lc, run, directive+" "+string(b))
	var p cliProcess
	if err := json.Unmarshal([]byte(strings.TrimSpace(out)), &p); err != nil {
		c.t.Fatalf("%s: %q: %v", directive, out, err)
	}
	return p
}

// TestBackgroundProcessesAreOneSetWithTheRWXCLI: a process started by the
// RWX CLI (`rwx sandbox background --name`) is listed, shown and stopped by
// nook; one started by nook is shown and stopped by the CLI; nook's list
// then shows both as the agent knows them.
func TestBackgroundProcessesAreOneSetWithTheRWXCLI(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	e.startDaemon()
	cli := e.fakeCLI(lc)
	repo := e.newRepo("bgshared", defaultConfig)
	run := e.startSandbox(repo)

	cli.cliDirective(lc, run, "__rwx_sandbox_process_start__", map[string]any{"key": "cliweb", "command": "echo from-the-cli; exec sleep 300"})
	e.mustNook(repo, "bg", "start", "--name", "nookjob", "--", "sh", "-c", "echo from-nook; exec sleep 300")

	list := decode[bgListJSON](t, e.mustNook(repo, "bg", "list", "--json").stdout)
	status := map[string]string{}
	for _, p := range list.Processes {
		status[p.Name] = p.Status
	}
	if status["cliweb"] != "running" || status["nookjob"] != "running" {
		t.Fatalf("nook bg list does not show both processes running: %+v", list.Processes)
	}
	waitUntil(t, 10e9, "the CLI's process log", func() bool {
		return strings.Contains(e.mustNook(repo, "bg", "logs", "cliweb").stdout, "from-the-cli")
	})

	// The CLI's view of nook's process: its logs, then a stop.
	logs := cli.cliDirective(lc, run, "__rwx_sandbox_process_logs__", map[string]any{"key": "nookjob"})
	waitUntil(t, 10e9, "nook's process log read by the CLI", func() bool {
		return strings.Contains(cli.sshRun(lc, run, "tail -n +1 -- '"+logs.StdoutPath+"'"), "from-nook")
	})
	if p := cli.cliDirective(lc, run, "__rwx_sandbox_process_stop__", map[string]any{"key": "nookjob"}); p.Status != "stopped" {
		t.Fatalf("the CLI stopping nook's process: %+v", p)
	}
	e.mustNook(repo, "bg", "stop", "cliweb")
	list = decode[bgListJSON](t, e.mustNook(repo, "bg", "list", "--json").stdout)
	for _, p := range list.Processes {
		if p.Status == "running" {
			t.Fatalf("process %s still runs after each client stopped the other's: %+v", p.Name, list.Processes)
		}
	}
	if len(list.Processes) != 2 {
		t.Fatalf("nook bg list after the stops: %+v, want both processes, stopped", list.Processes)
	}
}

package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestForwardToARunningProcessAndPredefinedProcesses: as RWX's tunnels and
// named processes (2026-09): a process predefined in the sandbox config is
// started by its key with its port forwarded; `nook bg forward` (and `nook
// forward`) forward a port of a process that already runs, started by nook
// (--key) or by the RWX CLI, without restarting it.
func TestForwardToARunningProcessAndPredefinedProcesses(t *testing.T) {
	t.Parallel()
	if os.Getenv("CI") == "true" {
		// CI has python3: a skip there would hide the test.
		if _, err := exec.LookPath("python3"); err != nil {
			t.Fatalf("CI needs python3 for this test: %v", err)
		}
	}
	python := sandboxPython(t)
	e := newEnv(t)
	lc := e.startLocalcloud()
	e.startDaemon()
	webPort, apiPort, cliPort := freePort(t), freePort(t), freePort(t)
	repo := e.newRepo("fwd", fmt.Sprintf(`tasks:
  - key: sandbox
    run: rwx-sandbox
    background-processes:
      - key: web
        run: %s -m http.server %d --bind 127.0.0.1
        port: %d
`, python, webPort, webPort))
	writeFile(t, filepath.Join(repo, "page.txt"), "served\n")
	run := e.startSandbox(repo)

	// Predefined, started by key: its port is forwarded.
	web := decode[bgJSON](t, e.mustNook(repo, "bg", "start", "--key", "web", "--json").stdout)
	if web.Forward == nil || web.Forward.TargetPort != webPort {
		t.Fatalf("predefined process web started without its forward: %+v", web)
	}
	waitServes(t, "the predefined process", web.Forward.URL+"/page.txt", "served\n")

	// Started without a port (--key as --name), forwarded afterwards.
	api := decode[bgJSON](t, e.mustNook(repo, "bg", "start", "--key", "api", "--json", "--",
		python, "-m", "http.server", fmt.Sprint(apiPort), "--bind", "127.0.0.1").stdout)
	if api.Forward != nil {
		t.Fatalf("api has a forward before it was asked: %+v", api)
	}
	fwd := decode[bgJSON](t, e.mustNook(repo, "bg", "forward", "--key", "api", "--port", fmt.Sprint(apiPort), "--json").stdout)
	if fwd.PID != api.PID || fwd.Forward == nil || fwd.Forward.TargetPort != apiPort {
		t.Fatalf("bg forward restarted the process or opened no forward: before %+v, after %+v", api, fwd)
	}
	waitServes(t, "the forward to a running process", fwd.Forward.URL+"/page.txt", "served\n")

	// The RWX CLI's process, forwarded by nook on its own target port.
	cli := e.fakeCLI(lc)
	started := cli.cliDirective(lc, run, "__rwx_sandbox_process_start__", map[string]any{
		"key": "cliweb", "targetPort": cliPort,
		"command": fmt.Sprintf("exec %s -m http.server %d --bind 127.0.0.1", python, cliPort)})
	if started.Status != "running" {
		t.Fatalf("the CLI's process: %+v", started)
	}
	got := decode[bgJSON](t, e.mustNook(repo, "forward", "cliweb", "--json").stdout)
	if got.Forward == nil || got.Forward.TargetPort != cliPort {
		t.Fatalf("nook forward of the CLI's process: %+v", got)
	}
	waitServes(t, "the forward to the CLI's process", got.Forward.URL+"/page.txt", "served\n")
	for _, name := range []string{"web", "api", "cliweb"} {
		e.mustNook(repo, "bg", "stop", "--key", name)
	}
}

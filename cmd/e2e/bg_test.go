package e2e

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

type bgJSON struct {
	RunID   string `json:"runId"`
	Name    string `json:"name"`
	Status  string `json:"status"`
	PID     int    `json:"pid"`
	Signal  string `json:"signal"`
	Forward *struct {
		URL        string `json:"url"`
		LocalPort  int    `json:"localPort"`
		TargetPort int    `json:"targetPort"`
		State      string `json:"state"`
	} `json:"forward"`
}

type bgListJSON struct {
	Processes []bgJSON `json:"processes"`
}

// sandboxPython finds a python3 the sandbox's PATH reaches, or skips.
func sandboxPython(t *testing.T) string {
	for _, p := range []string{"/usr/local/bin/python3", "/usr/bin/python3"} {
		if st, err := os.Stat(p); err == nil && st.Mode()&0o111 != 0 {
			return p
		}
	}
	missingTool(t, "python3 in /usr/local/bin or /usr/bin (the sandbox's HTTP server)", "apt-get install python3")
	return ""
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// fetch GETs url with a short timeout (no keep-alive: each try is a new
// forwarded connection).
func fetch(url string) (string, error) {
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		return "", fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	return string(b), err
}

func waitServes(t *testing.T, what, url, want string) {
	t.Helper()
	var last string
	var lastErr error
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		last, lastErr = fetch(url)
		if lastErr == nil && last == want {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("%s: %s served %q (err %v), want %q", what, url, last, lastErr, want)
}

// processGone: the pid no longer runs (or is a zombie nobody reaped yet).
func processGone(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return true
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	return len(f) > 0 && f[0] == "Z"
}

// TestBackgroundServerForwardOutlivesEverything: a background HTTP server in
// the sandbox, forwarded by `nook bg start --port`, serves the synced file
// after nook exits, after its SSH connection is killed, and after a daemon
// SIGKILL + restart; stop/restart/logs work; `nook stop` closes the forward
// and ends the process.
func TestBackgroundServerForwardOutlivesEverything(t *testing.T) {
	t.Parallel()
	python := sandboxPython(t)
	e := newEnv(t)
	lc := e.startLocalcloud()
	d := e.startDaemon()
	repo := e.newRepo("bg", defaultConfig)
	run := e.startSandbox(repo)
	evs := e.followEvents("0")

	// Uncommitted: it reaches the sandbox by the sync before the start.
	writeFile(t, filepath.Join(repo, "page.txt"), "served v1\n")
	port := freePort(t)
	r := e.mustNook(repo, "bg", "start", "--name", "web", "--port", fmt.Sprint(port), "--json", "--",
		python, "-m", "http.server", fmt.Sprint(port), "--bind", "127.0.0.1")
	p := decode[bgJSON](t, r.stdout)
	if p.Status != "running" || p.PID == 0 || p.Forward == nil || p.Forward.TargetPort != port || p.Forward.State != "listening" {
		t.Fatalf("bg start: %s", r)
	}
	url := p.Forward.URL + "/page.txt"
	// nook has exited: the daemon holds the forward.
	waitServes(t, "after nook exited", url, "served v1\n")
	evs.waitFor(t, 10*time.Second, "forward.opened", func(ev map[string]any) bool {
		data, _ := ev["data"].(map[string]any)
		return ev["type"] == "forward.opened" && data["name"] == "web"
	})
	lr := e.mustNook(repo, "list", "--json")
	if !strings.Contains(lr.stdout, `"forwards":[{"name":"web","localPort":`+fmt.Sprint(p.Forward.LocalPort)) || !strings.Contains(lr.stdout, `"state":"listening"`) {
		t.Fatalf("nook list does not show the forward: %s", lr)
	}

	// The SSH connection is killed: new connections go through the
	// reconnected one.
	lc.call(t, "POST", "/admin/runs/"+run+"/drop-connections", nil)
	waitServes(t, "after the SSH connection was killed", url, "served v1\n")

	// The daemon dies and comes back: the forward is reopened on its port.
	d.kill()
	e.startDaemon() // stopped by the test's cleanup
	waitServes(t, "after a daemon SIGKILL and restart", url, "served v1\n")

	// Logs: python logs each request on stderr.
	logs := e.mustNook(repo, "bg", "logs", "web")
	if !strings.Contains(logs.stderr, "GET /page.txt") {
		t.Fatalf("bg logs: %s", logs)
	}
	list := decode[bgListJSON](t, e.mustNook(repo, "bg", "list", "--json").stdout)
	if len(list.Processes) != 1 || list.Processes[0].Status != "running" || list.Processes[0].PID != p.PID {
		t.Fatalf("bg list: %+v", list)
	}

	// Stop closes the forward and ends the process; restart brings both
	// back on the same local port, serving the latest local file.
	st := decode[bgJSON](t, e.mustNook(repo, "bg", "stop", "web", "--json").stdout)
	if st.Status != "stopped" {
		t.Fatalf("bg stop: %+v", st)
	}
	waitUntil(t, 10*time.Second, "the stopped process to end", func() bool { return processGone(p.PID) })
	if _, err := fetch(url); err == nil {
		t.Fatal("the forward still serves after bg stop")
	}
	writeFile(t, filepath.Join(repo, "page.txt"), "served v2\n")
	rs := decode[bgJSON](t, e.mustNook(repo, "bg", "restart", "web", "--json").stdout)
	if rs.Forward == nil || rs.Forward.LocalPort != p.Forward.LocalPort || rs.PID == p.PID {
		t.Fatalf("bg restart: %+v", rs)
	}
	waitServes(t, "after restart", url, "served v2\n")

	// nook stop: the forward closes and nothing of the process is left.
	e.mustNook(repo, "stop")
	waitUntil(t, 15*time.Second, "the background process to end with the sandbox", func() bool { return processGone(rs.PID) })
	if _, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", p.Forward.LocalPort), time.Second); err == nil {
		t.Fatal("the local port still accepts after nook stop")
	}
	if lr := e.mustNook(repo, "list", "--json"); strings.Contains(lr.stdout, `"forwards"`) {
		t.Fatalf("nook list still shows a forward after stop: %s", lr)
	}
}

// TestBackgroundLocalPortInUseNamesHolder: a local port already taken is a
// clear error naming the holder, and nothing is started in the sandbox.
func TestBackgroundLocalPortInUseNamesHolder(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("bgport", defaultConfig)
	e.startSandbox(repo)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	taken := ln.Addr().(*net.TCPAddr).Port
	r := e.nook(repo, "bg", "start", "--name", "web", "--port", "8000", "--local-port", fmt.Sprint(taken), "--", "sleep", "60")
	want := fmt.Sprintf("local port %d is already in use by pid %d (", taken, os.Getpid())
	if r.code != 125 || !strings.Contains(r.stderr, want) || !strings.Contains(r.stderr, "--local-port") {
		t.Fatalf("bg start on a taken port: %s\nwant %q", r, want)
	}
	if list := decode[bgListJSON](t, e.mustNook(repo, "bg", "list", "--json").stdout); len(list.Processes) != 0 {
		t.Fatalf("a process was recorded although its port was taken: %+v", list)
	}
	if r := e.nook(repo, "bg", "logs", "web"); r.code != 125 || !strings.Contains(r.stderr, `no background process named "web"`) {
		t.Fatalf("logs of a process that never started: %s", r)
	}
	// Bad input is refused before anything happens.
	if r := e.nook(repo, "bg", "start", "--name", "a b", "--", "true"); r.code != 125 || !strings.Contains(r.stderr, "only letters") {
		t.Fatalf("bad name: %s", r)
	}
}

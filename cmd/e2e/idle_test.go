package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// idleStopConfig sets the daemon's idle_stop (scaled down from minutes to
// seconds: the warning comes half of it before, at most a minute).
func (e *env) idleStopConfig(stop string) {
	writeFile(e.t, filepath.Join(e.get("XDG_CONFIG_HOME"), "sandboxd", "config.json"), `{"idle_stop": "`+stop+`"}`)
}

type idleListJSON struct {
	Sessions []struct {
		RunID       string     `json:"runId"`
		Status      string     `json:"status"`
		Reason      string     `json:"reason"`
		IdleSeconds *int64     `json:"idleSeconds"`
		IdleStopAt  *time.Time `json:"idleStopAt"`
		Kept        bool       `json:"kept"`
	} `json:"sessions"`
}

// statusOf is the listed status (and reason) of run.
func (e *env) statusOf(dir, run string) (status, reason string) {
	e.t.Helper()
	l := decode[idleListJSON](e.t, e.mustNook(dir, "list", "--all", "--json").stdout)
	for _, s := range l.Sessions {
		if s.RunID == run {
			return s.Status, s.Reason
		}
	}
	return "", ""
}

func runEvent(typ, run string) func(map[string]any) bool {
	return func(ev map[string]any) bool { return ev["type"] == typ && ev["runId"] == run }
}

// TestIdleSandboxStopsAfterIdleStopWithItsEditsPulled: a sandbox nobody
// uses is announced (session.idle_warning) and stopped after idle_stop; a
// file written in it without a sync comes back into the checkout first;
// `nook list` shows the idle time and the stop; a kept sandbox stays.
func TestIdleSandboxStopsAfterIdleStopWithItsEditsPulled(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.idleStopConfig("4s")
	e.startDaemon()
	repo := e.newRepo("idle", defaultConfig)
	keptRepo := e.newRepo("kept", defaultConfig)
	run := e.startSandbox(repo)
	kept := e.startSandbox(keptRepo)
	e.mustNook(keptRepo, "keep")
	evs := e.followEvents("")
	e.mustNook(repo, "exec", "--", "true")
	// Not synced back by this exec: only the idle stop's pull brings it.
	e.mustNook(repo, "exec", "--no-sync", "--", "sh", "-c", "echo made while idle > made.txt")

	l := decode[idleListJSON](t, e.mustNook(repo, "list", "--json").stdout)
	for _, s := range l.Sessions {
		switch s.RunID {
		case run:
			if s.IdleSeconds == nil || s.IdleStopAt == nil || time.Until(*s.IdleStopAt) > 5*time.Second {
				t.Fatalf("nook list must show the idle time and the stop of %s: %+v", run, s)
			}
		case kept:
			if !s.Kept || s.IdleStopAt != nil {
				t.Fatalf("nook list must show %s kept, with no stop: %+v", kept, s)
			}
		}
	}
	if cfg := e.mustNook(repo, "config"); !strings.Contains(cfg.stdout, "idle stop after  4s") {
		t.Fatalf("nook config does not show the idle stop: %s", cfg)
	}
	text := e.mustNook(repo, "list")
	if !strings.Contains(text.stdout, "IDLE STOP") || !strings.Contains(text.stdout, "kept") {
		t.Fatalf("nook list shows no idle columns: %s", text)
	}

	warned := evs.waitFor(t, 20*time.Second, "session.idle_warning", runEvent("session.idle_warning", run))
	var w struct {
		StopsAt time.Time `json:"stopsAt"`
	}
	b, _ := json.Marshal(warned["data"])
	if json.Unmarshal(b, &w) != nil || w.StopsAt.IsZero() {
		t.Fatalf("the idle warning does not say when: %v", warned)
	}
	evs.waitFor(t, 20*time.Second, "session.stopped", runEvent("session.stopped", run))
	if st, reason := e.statusOf(repo, run); st != "stopped" || !strings.Contains(reason, "idle") {
		t.Fatalf("the idle sandbox must be stopped for being idle: %s (%s)", st, reason)
	}
	if got := readFile(t, filepath.Join(repo, "made.txt")); got != "made while idle\n" {
		t.Fatalf("the sandbox's edit was not pulled before the idle stop: %q", got)
	}
	if st, _ := e.statusOf(keptRepo, kept); st != "ready" {
		t.Fatalf("the kept sandbox must stay ready: %s", st)
	}
}

// TestBusySandboxesAreNotIdleStopped: a long command, an open shell, an
// open SSH session and a served forward keep their sandboxes through
// several idle_stop periods; once the command ends, its sandbox stops.
func TestBusySandboxesAreNotIdleStopped(t *testing.T) {
	t.Parallel()
	python := sandboxPython(t)
	e := newEnv(t)
	// Setting the four up can take longer than idle_stop on a loaded
	// machine: idle_stop is made short only once each is held.
	e.idleStopConfig("1h")
	e.startDaemon()
	longRepo := e.newRepo("long", defaultConfig)
	shellRepo := e.newRepo("shell", defaultConfig)
	sshRepo := e.newRepo("ssh", defaultConfig)
	webRepo := e.newRepo("web", defaultConfig)
	idleRepo := e.newRepo("idle", defaultConfig)
	long := e.startSandbox(longRepo)
	shell := e.startSandbox(shellRepo)
	sshRun := e.startSandbox(sshRepo)
	web := e.startSandbox(webRepo)
	// Nothing holds this one: its stop within the window shows the idle
	// loop ran under the short idle_stop while the others were checked.
	idle := e.startSandbox(idleRepo)

	// A long command: it runs until the test closes its stdin.
	longCmd := e.nookCmd(longRepo, "exec", "--", "sh", "-c", "echo started; cat >/dev/null")
	longIn, err := longCmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	longOut, err := longCmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var longErr strings.Builder
	longCmd.Stderr = &longErr
	if err := longCmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { longIn.Close(); _ = longCmd.Process.Kill(); _ = longCmd.Wait() })
	waitLine(t, longOut, "started", "the long command's first line")
	// An open shell.
	p := e.tmux(t, shellRepo, "nook shell; sleep 600")
	p.line("echo SHELL-$((40+2))")
	p.waitFor(`SHELL-42`)
	// An open SSH session through the daemon (the ProxyCommand of
	// nook ssh-config), idle on the wire.
	proxy := exec.Command(filepath.Join(binDir, "nook"), "proxy", "--stdio", "nook-"+sshRun)
	proxy.Dir, proxy.Env = sshRepo, e.vars
	stdin, err := proxy.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	proxyOut, err := proxy.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := proxy.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdin.Close(); _ = proxy.Process.Kill(); _ = proxy.Wait() })
	// The server's version line: the session is open.
	waitLine(t, proxyOut, "SSH-2.0-", "the sandbox's SSH version line through the proxy")
	// A server in the background, forwarded.
	port := freePort(t)
	bg := decode[bgJSON](t, e.mustNook(webRepo, "bg", "start", "--name", "web", "--port", fmt.Sprint(port), "--json", "--",
		python, "-m", "http.server", fmt.Sprint(port), "--bind", "127.0.0.1").stdout)
	if bg.Forward == nil {
		t.Fatalf("no forward: %+v", bg)
	}

	// Now only what holds a sandbox keeps it: three idle_stop periods
	// and more.
	e.idleStopConfig("3s")
	waitIdleStop(t, e, longRepo, 3)
	deadline := time.Now().Add(9 * time.Second)
	for time.Now().Before(deadline) {
		if _, err := fetch(bg.Forward.URL + "/"); err != nil {
			t.Errorf("the forward stopped serving: %v", err)
			break
		}
		time.Sleep(time.Second)
	}
	time.Sleep(time.Until(deadline))
	for name, run := range map[string]string{"long command": long, "open shell": shell, "open SSH session": sshRun, "forwarded server": web} {
		if st, reason := e.statusOf(longRepo, run); st != "ready" {
			t.Errorf("the sandbox with a %s was stopped: %s (%s)", name, st, reason)
		}
	}
	if st, reason := e.statusOf(longRepo, idle); st != "stopped" || !strings.Contains(reason, "idle") {
		t.Errorf("the sandbox nothing holds was not idle-stopped within 9s of idle_stop 3s: %s (%s)", st, reason)
	}
	longIn.Close()
	if err := longCmd.Wait(); err != nil {
		t.Fatalf("the long command failed: %v\n%s", err, longErr.String())
	}
	// The command ended, the SSH session closed: idle now, they stop
	// after idle_stop (the SSH one was never synced: nothing to pull).
	stdin.Close()
	_ = proxy.Wait()
	stopBy := time.Now().Add(20 * time.Second)
	for _, run := range []string{long, sshRun} {
		for {
			st, reason := e.statusOf(longRepo, run)
			if st == "stopped" && strings.Contains(reason, "idle") {
				break
			}
			if time.Now().After(stopBy) {
				t.Fatalf("sandbox %s, idle now, was not idle-stopped: %s (%s)", run, st, reason)
			}
			time.Sleep(500 * time.Millisecond)
		}
	}
}

// waitLine reads r until a line starting with prefix, for at most a
// minute; what keeps reading r after it is discarded.
func waitLine(t *testing.T, r io.Reader, prefix, what string) {
	t.Helper()
	found := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(r)
		ok := false
		for sc.Scan() {
			if !ok && strings.HasPrefix(sc.Text(), prefix) {
				ok = true
				found <- true
			}
		}
		if !ok {
			found <- false
		}
	}()
	select {
	case ok := <-found:
		if !ok {
			t.Fatalf("waiting for %s: the output ended without it", what)
		}
	case <-time.After(time.Minute):
		t.Fatalf("waiting for %s: nothing within a minute", what)
	}
}

// waitIdleStop waits until the daemon has reloaded its config and applies
// an idle_stop of secs seconds.
func waitIdleStop(t *testing.T, e *env, dir string, secs float64) {
	t.Helper()
	for by := time.Now().Add(30 * time.Second); ; {
		var cfg struct {
			IdleStopSeconds float64 `json:"idleStopSeconds"`
		}
		if r := e.nook(dir, "config", "--json"); r.code == 0 && json.Unmarshal([]byte(r.stdout), &cfg) == nil && cfg.IdleStopSeconds == secs {
			return
		}
		if time.Now().After(by) {
			t.Fatalf("the daemon did not take idle_stop %vs from its changed config file within 30s", secs)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

//go:build linux

package helper

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/internal/helperproto"
	"github.com/sandboxd/sandboxd/internal/testutil"
)

// shConn stands in for a connection: each exec request is /bin/sh -c in
// the checkout, as the agent runs it, and the managed-process directives
// start and stop processes of their own session that outlive the request
// (agent), as RWX's agent and localcloud's do.
type shConn struct {
	dir   string
	done  chan struct{}
	mu    sync.Mutex
	cmds  []string
	agent *agent
}

// agent is the managed processes of one sandbox, shared by its
// connections; none: the agent knows no directives (exit 127).
type agent struct {
	none  bool
	mu    sync.Mutex
	procs map[string]*exec.Cmd
	ended map[string]chan struct{}
}

func newAgent(t *testing.T) *agent {
	a := &agent{procs: map[string]*exec.Cmd{}, ended: map[string]chan struct{}{}}
	t.Cleanup(func() {
		a.mu.Lock()
		keys := make([]string, 0, len(a.procs))
		for k := range a.procs {
			keys = append(keys, k)
		}
		a.mu.Unlock()
		for _, k := range keys {
			a.stop(k)
		}
	})
	return a
}

func (a *agent) stop(key string) bool {
	a.mu.Lock()
	cmd, ended := a.procs[key], a.ended[key]
	delete(a.procs, key)
	a.mu.Unlock()
	if cmd == nil {
		return false
	}
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-ended:
	case <-time.After(5 * time.Second):
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-ended
	}
	return true
}

func (a *agent) directive(dir, name, arg string, stdio sshpool.Stdio) sshpool.ExitStatus {
	if a == nil || a.none {
		return sshpool.ExitStatus{Code: 127}
	}
	var req struct{ Key, Command string }
	if err := json.Unmarshal([]byte(arg), &req); err != nil {
		return sshpool.ExitStatus{Code: 1}
	}
	status := "stopped"
	switch name {
	case directiveStart:
		a.stop(req.Key)
		cmd := exec.Command("/bin/sh", "-c", req.Command)
		cmd.Dir = dir
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		if err := cmd.Start(); err != nil {
			return sshpool.ExitStatus{Code: 1}
		}
		ended := make(chan struct{})
		go func() { _ = cmd.Wait(); close(ended) }()
		a.mu.Lock()
		a.procs[req.Key], a.ended[req.Key] = cmd, ended
		a.mu.Unlock()
		status = "running"
	case directiveStop:
		if !a.stop(req.Key) {
			fmt.Fprintf(stdio.Stderr, "no background process named %q", req.Key)
			return sshpool.ExitStatus{Code: 1}
		}
	default:
		return sshpool.ExitStatus{Code: 1}
	}
	fmt.Fprintf(stdio.Stdout, `{"key":%q,"status":%q,"stderrPath":"/tmp/x"}`+"\n", req.Key, status)
	return sshpool.ExitStatus{}
}

func newShConn(t *testing.T) *shConn {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "checkout")
	run(t, "", "git", "init", "-q", dir)
	return &shConn{dir: dir, done: make(chan struct{}), agent: newAgent(t)}
}

// again is another connection to c's sandbox.
func (c *shConn) again() *shConn {
	return &shConn{dir: c.dir, done: make(chan struct{}), agent: c.agent}
}

func (c *shConn) ExecOnce(ctx context.Context, command string, stdio sshpool.Stdio) (sshpool.ExitStatus, error) {
	c.mu.Lock()
	c.cmds = append(c.cmds, command)
	c.mu.Unlock()
	if name, arg, ok := strings.Cut(command, " "); ok && strings.HasPrefix(name, "__rwx_sandbox_process_") {
		return c.agent.directive(c.dir, name, arg, stdio), nil
	}
	cmd := exec.CommandContext(ctx, "/bin/sh", "-c", command)
	cmd.Dir = c.dir
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdio.Stdin, stdio.Stdout, stdio.Stderr
	cmd.WaitDelay = time.Second
	err := cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return sshpool.ExitStatus{Code: ee.ExitCode()}, nil
	}
	return sshpool.ExitStatus{}, err
}

func (c *shConn) Done() <-chan struct{} { return c.done }

func (c *shConn) uploads() int { return c.count(".install.") }

// count is how many of c's exec requests hold s.
func (c *shConn) count(s string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, cmd := range c.cmds {
		if strings.Contains(cmd, s) {
			n++
		}
	}
	return n
}

func run(t *testing.T, dir string, name string, args ...string) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
}

// TestMain removes the helper binary built for the package's tests.
func TestMain(m *testing.M) {
	code := m.Run()
	testutil.Cleanup()
	os.Exit(code)
}

// binary builds sandboxd-helper once.
func binary(t *testing.T) string {
	t.Helper()
	return testutil.Binary(t, "github.com/sandboxd/sandboxd/cmd/sandboxd-helper")
}

func waitFor(t *testing.T, m *Manager, c Conn) (string, string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if name, inst := m.For(c); inst != "" {
			return name, inst
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatal("the helper never served")
	return "", ""
}

// dialServer connects to the server of instance in checkout dir, through
// /proc as the helper does (the path is longer than a socket address).
func dialServer(t *testing.T, dir, instance string) (net.Conn, error) {
	t.Helper()
	d, err := os.Open(filepath.Join(dir, ".git", "sandboxd", "helper"))
	if err != nil {
		return nil, err
	}
	defer d.Close()
	return net.Dial("unix", fmt.Sprintf("/proc/self/fd/%d/%s.sock", d.Fd(), instance))
}

// waitGone waits until the server of instance no longer answers, failing
// with msg after 10 seconds.
func waitGone(t *testing.T, dir, instance, msg string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		conn, err := dialServer(t, dir, instance)
		if err != nil {
			return
		}
		conn.Close()
		if time.Now().After(deadline) {
			t.Fatal(msg)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func isolate(t *testing.T) {
	home := t.TempDir()
	t.Setenv("HOME", home)
	t.Setenv("XDG_CONFIG_HOME", filepath.Join(home, ".config"))
	t.Setenv("GIT_CONFIG_NOSYSTEM", "1")
	// The helpers started here run on this machine: their holder stays
	// in the test's directory, not in the machine's /dev/shm.
	t.Setenv("SANDBOXD_HOLD_ROOT", filepath.Join(home, "hold"))
}

// The helper is uploaded once, checked, started as a managed process,
// and outlives the connection that started it: the next connection finds
// the same server (ping), with no upload and no second start.
func TestServerOutlivesItsConnectionAndIsFoundAgain(t *testing.T) {
	isolate(t)
	m := New(Options{Binary: binary(t), Platform: Platform(runtime.GOOS, runtime.GOARCH)})
	defer m.Close()
	c := newShConn(t)
	if name, inst := m.For(c); name != "" || inst != "" {
		t.Fatal("the helper was offered before it served")
	}
	name, inst := waitFor(t, m, c)
	installed := filepath.Join(c.dir, ".git", "sandboxd", "bin", name)
	if _, err := os.Stat(installed); err != nil {
		t.Fatalf("not installed: %v", err)
	}
	if conn, err := dialServer(t, c.dir, inst); err != nil {
		t.Fatalf("the server does not answer: %v", err)
	} else {
		conn.Close()
	}
	if n := c.count(directiveStart + ` {"command"`); n != 1 {
		t.Fatalf("%d start directives, want 1", n)
	}
	close(c.done)
	c2 := c.again()
	defer close(c2.done)
	if _, inst2 := waitFor(t, m, c2); inst2 != inst {
		t.Fatalf("a new connection got server %s, not the one still running, %s", inst2, inst)
	}
	if n := c.uploads() + c2.uploads(); n != 1 {
		t.Fatalf("%d uploads, want 1", n)
	}
	if n := c2.count(directiveStart); n != 0 {
		t.Fatalf("the second connection started the server again (%d starts)", n)
	}
	// The session ends: the server is stopped.
	m.Stop(context.Background(), c2)
	waitGone(t, c.dir, inst, "the server outlived the session's end")
}

// A server that went away (killed in the sandbox) is started again at
// the first use after the recheck time; meanwhile the old instance is
// offered (the scripts then stage the whole tree).
func TestAKilledServerIsStartedAgain(t *testing.T) {
	isolate(t)
	now := time.Now()
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	m := New(Options{Binary: binary(t), Platform: Platform(runtime.GOOS, runtime.GOARCH), Now: clock})
	defer m.Close()
	c := newShConn(t)
	defer close(c.done)
	_, inst := waitFor(t, m, c)
	c.agent.stop(helperproto.ProcessKey)
	waitGone(t, c.dir, inst, "the server was not killed")
	if _, got := m.For(c); got != inst {
		t.Fatalf("before the recheck time the helper offered %q, want %s", got, inst)
	}
	mu.Lock()
	now = now.Add(11 * time.Minute)
	mu.Unlock()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, got := m.For(c); got != "" && got != inst {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the killed server was not started again")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// An agent without managed processes (exit 127): no helper on that
// connection, said once per run, and not tried again.
func TestAnAgentWithoutManagedProcessesFallsBackOnce(t *testing.T) {
	isolate(t)
	var mu sync.Mutex
	var said []string
	m := New(Options{Binary: binary(t), Platform: Platform(runtime.GOOS, runtime.GOARCH),
		OnFallback: func(run, reason string) { mu.Lock(); said = append(said, run+": "+reason); mu.Unlock() }})
	defer m.Close()
	c := &runConn{shConn: newShConn(t), run: "run-1"}
	c.agent.none = true
	defer close(c.done)
	deadline := time.Now().Add(20 * time.Second)
	for !m.Unavailable(c) {
		m.For(c)
		if time.Now().After(deadline) {
			t.Fatal("the helper never gave up")
		}
		time.Sleep(20 * time.Millisecond)
	}
	c2 := &runConn{shConn: c.again(), run: "run-1"}
	defer close(c2.done)
	for !m.Unavailable(c2) {
		m.For(c2)
		if time.Now().After(deadline) {
			t.Fatal("the helper never gave up on the second connection")
		}
		time.Sleep(20 * time.Millisecond)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(said) != 1 || !strings.Contains(said[0], "run-1: ") || !strings.Contains(said[0], "managed processes") {
		t.Fatalf("the fallback was said %d times: %q", len(said), said)
	}
	if ok, detail := m.Status(c); !ok || !strings.Contains(detail, "managed processes") {
		t.Fatalf("status = %v %q", ok, detail)
	}
}

type runConn struct {
	*shConn
	run string
}

func (c *runConn) RunID() string { return c.run }

// A damaged copy in the sandbox (its version does not print the binary's
// hash) is replaced; a sandbox of another platform gets nothing.
func TestReplacesADamagedCopyAndSkipsOtherPlatforms(t *testing.T) {
	isolate(t)
	bin := binary(t)
	m := New(Options{Binary: bin, Platform: Platform(runtime.GOOS, runtime.GOARCH)})
	defer m.Close()
	if err := m.loadBinary(m.bin); err != nil {
		t.Fatal(err)
	}
	c := newShConn(t)
	installed := filepath.Join(c.dir, ".git", "sandboxd", "bin", m.bin.name)
	if err := os.MkdirAll(filepath.Dir(installed), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(installed, []byte("#!/bin/sh\necho sandboxd-helper 0000\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	waitFor(t, m, c)
	if c.uploads() != 1 {
		t.Fatal("the damaged copy was not replaced")
	}
	close(c.done)

	other := New(Options{Binary: bin, Platform: "Plan9 mips", RetryAfter: time.Hour})
	defer other.Close()
	c3 := newShConn(t)
	other.For(c3)
	deadline := time.Now().Add(10 * time.Second)
	for {
		other.mu.Lock()
		st := other.conns[c3]
		failed := st != nil && !st.failed.IsZero()
		other.mu.Unlock()
		if failed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the probe never concluded")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if name, inst := other.For(c3); name != "" || inst != "" || c3.uploads() != 0 {
		t.Fatalf("another platform got the helper: %q %q, %d uploads", name, inst, c3.uploads())
	}
	// Not asked again on that connection, however long it lives.
	c3.mu.Lock()
	probes := len(c3.cmds)
	c3.mu.Unlock()
	other.o.Now = func() time.Time { return time.Now().Add(48 * time.Hour) }
	other.For(c3)
	time.Sleep(100 * time.Millisecond)
	c3.mu.Lock()
	again := len(c3.cmds)
	c3.mu.Unlock()
	if again != probes {
		t.Fatal("a sandbox of another platform was probed again")
	}
	if _, err := os.Stat(filepath.Join(c3.dir, ".git", "sandboxd", "bin")); !errors.Is(err, os.ErrNotExist) {
		t.Fatal("something was written to a sandbox of another platform")
	}
	close(c3.done)
}

// Without a binary nothing is ever run.
func TestNoBinaryNoHelper(t *testing.T) {
	m := New(Options{})
	defer m.Close()
	c := &shConn{dir: t.TempDir(), done: make(chan struct{})}
	if name, inst := m.For(c); name != "" || inst != "" || len(c.cmds) != 0 {
		t.Fatal("a helper without a binary")
	}
	var nilManager *Manager
	if name, _ := nilManager.For(c); name != "" {
		t.Fatal("a nil manager offered a helper")
	}
}

// A reloaded configuration that turns the helper off stops its servers
// and offers it no more; turning it on again (here: another copy of the
// binary) serves again on the same connection.
func TestSetBinaryStopsAndRestartsServers(t *testing.T) {
	isolate(t)
	m := New(Options{Binary: binary(t), Platform: Platform(runtime.GOOS, runtime.GOARCH)})
	defer m.Close()
	c := newShConn(t)
	defer close(c.done)
	_, inst := waitFor(t, m, c)

	m.SetBinary("")
	if name, inst2 := m.For(c); name != "" || inst2 != "" {
		t.Fatal("the helper was offered after it was turned off")
	}
	waitGone(t, c.dir, inst, "the server outlived the helper being turned off")

	other := filepath.Join(t.TempDir(), "copy")
	b, err := os.ReadFile(binary(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(other, b, 0o755); err != nil {
		t.Fatal(err)
	}
	m.SetBinary(other)
	if _, inst3 := waitFor(t, m, c); inst3 == inst {
		t.Fatal("the stopped server was offered again")
	}
}

// dropOnce is a connection that breaks under its first install, as a
// connection dropped by the network does, before it says it is done.
type dropOnce struct {
	*shConn
	dropped atomic.Bool
}

func (c *dropOnce) ExecOnce(ctx context.Context, command string, stdio sshpool.Stdio) (sshpool.ExitStatus, error) {
	if strings.Contains(command, ".install.") && c.dropped.CompareAndSwap(false, true) {
		return sshpool.ExitStatus{}, fmt.Errorf("install: %w", sshpool.ErrConnectionLost)
	}
	return c.shConn.ExecOnce(ctx, command, stdio)
}

// A connection lost under the install is no failure of the helper's: the
// next connection installs and starts it at once, without the minute's
// wait a failed helper gets.
func TestAConnectionLostDuringTheInstallIsTriedAgainAtOnce(t *testing.T) {
	isolate(t)
	now := time.Now()
	m := New(Options{Binary: binary(t), Platform: Platform(runtime.GOOS, runtime.GOARCH), Now: func() time.Time { return now }})
	defer m.Close()
	sh := newShConn(t)
	c := &runConn{shConn: sh, run: "run-1"}
	lost := &dropOnce{shConn: sh}
	first := &runConnExec{runConn: c, exec: lost}
	deadline := time.Now().Add(20 * time.Second)
	for !lost.dropped.Load() {
		m.For(first)
		if time.Now().After(deadline) {
			t.Fatal("the install was never tried")
		}
		time.Sleep(20 * time.Millisecond)
	}
	close(sh.done)
	c2 := &runConn{shConn: sh.again(), run: "run-1"}
	defer close(c2.done)
	for {
		if _, inst := m.For(c2); inst != "" {
			break
		}
		if m.Unavailable(c2) || time.Now().After(deadline) {
			t.Fatalf("after a connection lost under the install the next connection got no helper (status: %v)", statusOf(m, c2))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// runConnExec is c whose exec requests go to exec.
type runConnExec struct {
	*runConn
	exec interface {
		ExecOnce(context.Context, string, sshpool.Stdio) (sshpool.ExitStatus, error)
	}
}

func (c *runConnExec) ExecOnce(ctx context.Context, command string, stdio sshpool.Stdio) (sshpool.ExitStatus, error) {
	return c.exec.ExecOnce(ctx, command, stdio)
}

func statusOf(m *Manager, c Conn) string {
	ok, detail := m.Status(c)
	return fmt.Sprint(ok, " ", detail)
}

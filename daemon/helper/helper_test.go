//go:build linux

package helper

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/internal/testutil"
)

// shConn stands in for a connection: each exec request is /bin/sh -c in
// the checkout, as the agent runs it.
type shConn struct {
	dir  string
	done chan struct{}
	mu   sync.Mutex
	cmds []string
}

func newShConn(t *testing.T) *shConn {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "checkout")
	run(t, "", "git", "init", "-q", dir)
	return &shConn{dir: dir, done: make(chan struct{})}
}

func (c *shConn) ExecOnce(ctx context.Context, command string, stdio sshpool.Stdio) (sshpool.ExitStatus, error) {
	c.mu.Lock()
	c.cmds = append(c.cmds, command)
	c.mu.Unlock()
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

func (c *shConn) uploads() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, cmd := range c.cmds {
		if strings.Contains(cmd, ".install.") {
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
}

// The helper is uploaded once, checked, run as a server for the
// connection's life, and found again (not uploaded) on the next connection.
func TestInstallsOnceAndServesPerConnection(t *testing.T) {
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
	if _, err := os.Stat(filepath.Join(c.dir, ".git", "sandboxd", "helper", inst+".sock")); err != nil {
		t.Fatalf("no server socket: %v", err)
	}
	if conn, err := dialServer(t, c.dir, inst); err != nil {
		t.Fatalf("the server does not answer: %v", err)
	} else {
		conn.Close()
	}
	// The connection ends: the server goes, and a new connection finds the
	// installed copy.
	close(c.done)
	waitGone(t, c.dir, inst, "the server outlived its connection")
	c2 := &shConn{dir: c.dir, done: make(chan struct{})}
	if _, inst2 := waitFor(t, m, c2); inst2 == inst {
		t.Fatal("a new connection got the old server")
	}
	if n := c.uploads() + c2.uploads(); n != 1 {
		t.Fatalf("%d uploads, want 1", n)
	}
	close(c2.done)
}

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

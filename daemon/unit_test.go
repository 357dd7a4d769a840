package daemon

import (
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestIdleTracker(t *testing.T) {
	t0 := time.Unix(1000, 0)
	tr := newIdleTracker(t0)
	if d := tr.observe(t0.Add(time.Second), 0, 0); d != time.Second {
		t.Fatalf("idle %s, want 1s", d)
	}
	if d := tr.observe(t0.Add(2*time.Second), 1, 0); d != 0 {
		t.Fatalf("live but idle %s", d)
	}
	if d := tr.observe(t0.Add(3*time.Second), 0, 0); d != time.Second {
		t.Fatalf("idle %s since the last live sample, want 1s", d)
	}
	// A connection accepted and finished between two samples is activity.
	if d := tr.observe(t0.Add(10*time.Second), 0, 1); d != 0 {
		t.Fatalf("a new connection did not reset idleness: %s", d)
	}
	if d := tr.observe(t0.Add(12*time.Second), 0, 1); d != 2*time.Second {
		t.Fatalf("idle %s, want 2s", d)
	}
}

func TestCheckSocketPath(t *testing.T) {
	ok := "/" + strings.Repeat("a", MaxSocketPathLen-1)
	if err := checkSocketPath(ok); err != nil {
		t.Fatalf("%d bytes refused: %v", len(ok), err)
	}
	var pe *SocketPathError
	if err := checkSocketPath(ok + "b"); !errors.As(err, &pe) || pe.Len != MaxSocketPathLen+1 {
		t.Fatalf("%d bytes: %v", len(ok)+1, err)
	}
	if MaxSocketPathLen != 107 {
		t.Logf("MaxSocketPathLen is %d on this platform", MaxSocketPathLen)
	}
}

func TestEnsurePrivateDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "rt")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := ensurePrivateDir(dir, os.Getuid()); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(dir); fi.Mode().Perm() != 0o700 {
		t.Errorf("mode %v, want 0700", fi.Mode().Perm())
	}
	if err := ensurePrivateDir(dir, os.Getuid()+1); err == nil || !strings.Contains(err.Error(), "belongs to uid") {
		t.Errorf("a directory of another user was accepted: %v", err)
	}
	link := dir + "-link"
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	if err := ensurePrivateDir(link, os.Getuid()); err == nil {
		t.Error("a symlink was accepted as the socket directory")
	}
}

func TestRemoveStaleSocketLeavesLiveOnes(t *testing.T) {
	dir, err := os.MkdirTemp("", "nooks")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "live.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	log := slog.New(slog.DiscardHandler)
	if err := removeStaleSocket(path, log); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("a live socket was not defended: %v", err)
	}
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("live socket removed: %v", err)
	}
}

func TestPIDFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "sandboxd.pid")
	if pid, _ := readPIDFile(path); pid != 0 {
		t.Fatalf("missing file gave pid %d", pid)
	}
	if err := writePIDFile(path, os.Getpid(), "/run/x.sock"); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o600 {
		t.Errorf("mode %v", fi.Mode().Perm())
	}
	pid, sock := readPIDFile(path)
	if pid != os.Getpid() || sock != "/run/x.sock" {
		t.Fatalf("read %d %q", pid, sock)
	}
	for _, content := range []string{"", "garbage\n", "-4\n/x\n"} {
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		if pid, _ := readPIDFile(path); pid != 0 {
			t.Errorf("%q gave pid %d", content, pid)
		}
	}
	e := &AlreadyRunningError{Database: "/s/sandboxd.db"}
	if !errors.Is(e, ErrAlreadyRunning) || !strings.Contains(e.Error(), "/s/sandboxd.db") {
		t.Errorf("without a pid file: %v", e)
	}
}

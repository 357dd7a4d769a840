package testutil

import (
	"bufio"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestLockedBufferTakesWritesWhileRead(t *testing.T) {
	var b LockedBuffer
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 100 {
				_, _ = b.Write([]byte("x"))
				_ = b.String()
			}
		}()
	}
	wg.Wait()
	if b.Len() != 400 || len(b.Bytes()) != 400 {
		t.Fatalf("got %d bytes, want 400", b.Len())
	}
	b.Reset()
	if b.String() != "" {
		t.Fatal("Reset left bytes")
	}
}

func TestGitReadsNoUserConfigAndTrims(t *testing.T) {
	home := t.TempDir()
	// A user configuration that would change what the test sees.
	if err := os.WriteFile(filepath.Join(home, ".gitconfig"), []byte("[init]\n\tdefaultBranch = fromuser\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("HOME", home)
	dir := t.TempDir()
	Git(t, dir, "init", "-q")
	if got := Git(t, dir, "symbolic-ref", "HEAD"); got == "refs/heads/fromuser" || strings.HasSuffix(got, "\n") {
		t.Fatalf("HEAD = %q: the user's configuration was read, or the output not trimmed", got)
	}
	Git(t, dir, "commit", "-q", "--allow-empty", "-m", "c")
	if got := Git(t, dir, "log", "-1", "--format=%an"); got != "t" {
		t.Fatalf("author %q, want t", got)
	}
}

func TestGarbageListenerAnswersGarbageThenCloses(t *testing.T) {
	addr := GarbageListener(t, "not ssh\r\n")
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if line != "not ssh\r\n" || err != nil {
		t.Fatalf("read %q, %v", line, err)
	}
	if _, err := net.DialTimeout("tcp", ClosedAddr(t), 5*time.Second); err == nil {
		t.Fatal("a connection to ClosedAddr succeeded")
	}
}

// A missing tool skips the test on a developer's machine and fails it
// under CI: run as a child test binary, whose outcome is read.
func TestMissingToolFailsUnderCIAndSkipsElsewhere(t *testing.T) {
	if os.Getenv("TESTUTIL_CHILD") == "1" {
		NeedTool(t, "nook-no-such-tool", "apt-get install nothing")
		return
	}
	for _, c := range []struct {
		ci   string
		want string
	}{{"true", "--- FAIL"}, {"", "--- SKIP"}} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestMissingToolFailsUnderCIAndSkipsElsewhere$", "-test.v")
		cmd.Env = append(os.Environ(), "TESTUTIL_CHILD=1", "CI="+c.ci)
		out, _ := cmd.CombinedOutput()
		if !strings.Contains(string(out), c.want) || !strings.Contains(string(out), "nook-no-such-tool is not installed") {
			t.Errorf("CI=%q: want %s naming the tool:\n%s", c.ci, c.want, out)
		}
	}
}

func TestRaceEnvKeepsTheUsersSettings(t *testing.T) {
	t.Setenv("GORACE", "halt_on_error=1")
	if got := RaceEnv(); got != "GORACE=halt_on_error=1 atexit_sleep_ms=0" {
		t.Fatalf("RaceEnv() = %q", got)
	}
}

func TestBinariesAreTakenFromMakeTestsBuild(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "nook"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv(PrebuiltEnv, dir)
	got, err := Binaries(false, "github.com/sandboxd/sandboxd/cmd/nook")
	if err != nil || got != dir {
		t.Fatalf("Binaries = %q, %v; want the prebuilt %s", got, err, dir)
	}
	// One binary missing there: built here instead (not run: the test only
	// checks where it would look).
	if prebuilt(false, []string{"github.com/sandboxd/sandboxd/cmd/nook", "github.com/sandboxd/sandboxd/cmd/sandboxd"}) != "" {
		t.Fatal("a prebuilt directory lacking a binary was taken")
	}
}

package provision

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

func TestParseConfig(t *testing.T) {
	d, err := ParseConfig([]byte(`
base:
  image: ubuntu:24.04
tasks:
  - key: code
    call: git/clone 1.9.0
  - key: deps
    use: code
    run: echo deps > deps.txt
  - key: more
    use: [deps]
    run: |
      echo more
  - key: sandbox
    use: more
    run: rwx-sandbox
  - key: after
    run: echo never
`))
	if err != nil {
		t.Fatal(err)
	}
	if d.SandboxKey != "sandbox" || len(d.Steps) != 2 || d.Steps[0].Key != "deps" || d.Steps[1].Key != "more" {
		t.Fatalf("definition %+v", d)
	}
	for _, bad := range []string{"tasks: [", "tasks: []", "tasks:\n  - key: a\n    run: echo\n", "tasks: 3"} {
		if _, err := ParseConfig([]byte(bad)); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("config %q: want ErrInvalidConfig, got %v", bad, err)
		}
	}
}

// origin makes a bare repository with two commits; it returns its path and
// the first commit.
func origin(t testing.TB) (string, string) {
	t.Helper()
	root := t.TempDir()
	src := filepath.Join(root, "src")
	os.MkdirAll(src, 0o755)
	testutil.Git(t, src, "init", "-q", "-b", "main")
	os.WriteFile(filepath.Join(src, "a.txt"), []byte("one\n"), 0o644)
	testutil.Git(t, src, "add", ".")
	testutil.Git(t, src, "commit", "-q", "-m", "one")
	first := testutil.Git(t, src, "rev-parse", "HEAD")
	os.WriteFile(filepath.Join(src, "a.txt"), []byte("two\n"), 0o644)
	testutil.Git(t, src, "commit", "-q", "-am", "two")
	bare := filepath.Join(root, "origin.git")
	testutil.Git(t, root, "clone", "-q", "--bare", src, bare)
	return bare, first
}

func TestCloneAtSha(t *testing.T) {
	bare, first := origin(t)
	dest := filepath.Join(t.TempDir(), "ws")
	var log bytes.Buffer
	if err := Clone(context.Background(), CloneOptions{Origin: bare, Sha: first, Branch: "feature/x", Dest: dest, Log: &log}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dest, "a.txt")); string(b) != "one\n" {
		t.Fatalf("checked out %q", b)
	}
	if br := testutil.Git(t, dest, "rev-parse", "--abbrev-ref", "HEAD"); br != "feature/x" {
		t.Fatalf("branch %q", br)
	}
	if !strings.Contains(log.String(), "git clone") {
		t.Fatalf("log: %q", log.String())
	}
}

func TestCloneFailuresAreClear(t *testing.T) {
	bare, _ := origin(t)
	missing := filepath.Join(t.TempDir(), "nope.git")
	err := Clone(context.Background(), CloneOptions{Origin: missing, Dest: filepath.Join(t.TempDir(), "ws")})
	if err == nil || !strings.Contains(err.Error(), missing) || !strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("missing origin: %v", err)
	}
	err = Clone(context.Background(), CloneOptions{Origin: bare, Sha: strings.Repeat("ab", 20), Dest: filepath.Join(t.TempDir(), "ws")})
	if err == nil || !strings.Contains(err.Error(), "push it") {
		t.Fatalf("unknown sha: %v", err)
	}
	if err := Clone(context.Background(), CloneOptions{Origin: bare, Sha: "HEAD; rm -rf /", Dest: t.TempDir()}); err == nil {
		t.Fatal("a malformed sha was accepted")
	}
}

func TestRunSteps(t *testing.T) {
	dir := t.TempDir()
	var log bytes.Buffer
	env := []string{"PATH=/usr/bin:/bin", "X=42"}
	err := RunSteps(context.Background(), []Step{{Key: "a", Run: "echo $X > a.txt"}, {Key: "b", Run: "echo boom; exit 3"}, {Key: "c", Run: "touch c"}}, dir, env, &log)
	var se *StepError
	if !errors.As(err, &se) || se.Key != "b" || se.Output != "boom" {
		t.Fatalf("want step b to fail with its output, got %#v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "a.txt")); string(b) != "42\n" {
		t.Fatalf("step a: %q", b)
	}
	if _, err := os.Stat(filepath.Join(dir, "c")); err == nil {
		t.Fatal("step c ran after a failure")
	}
	if !strings.Contains(log.String(), "boom") {
		t.Fatalf("log: %q", log.String())
	}
}

func TestRunStepsCancelKillsGroup(t *testing.T) {
	// The step's shell starts two background processes and records their
	// pids; cancelling must end all of them, not only the shell.
	dir := t.TempDir()
	pids := filepath.Join(dir, "pids")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- RunSteps(ctx, []Step{{Key: "slow", Run: "sleep 300 & echo $! >> " + pids + "; sleep 300 & echo $! >> " + pids + "; wait"}}, dir, nil, nil)
	}()
	var children []int
	waitFor(t, 10*time.Second, "the step's processes to start", func() bool {
		b, _ := os.ReadFile(pids)
		children = children[:0]
		for _, f := range strings.Fields(string(b)) {
			if pid, err := strconv.Atoi(f); err == nil {
				children = append(children, pid)
			}
		}
		return len(children) == 2
	})
	t.Cleanup(func() {
		for _, pid := range children {
			if alive(pid) {
				syscall.Kill(pid, syscall.SIGKILL) // the test failed: leave nothing behind
			}
		}
	})
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("got %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("cancel did not stop the step")
	}
	for _, pid := range children {
		waitFor(t, 10*time.Second, fmt.Sprintf("background process %d of the cancelled step to end", pid), func() bool { return !alive(pid) })
	}
}

// alive reports whether pid runs (a zombie waiting for its reaper does not).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// "pid (comm) S ...": the state follows the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}

func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestCloneFallsBackWhenObjectFilesCannotBeCopied: a clone by path copies
// the object files one by one; when one cannot be copied (gc deleted it
// meanwhile, or it is something a local clone refuses, as here a dangling
// link) the clone goes through git's transport instead and succeeds.
func TestCloneFallsBackWhenObjectFilesCannotBeCopied(t *testing.T) {
	bare, first := origin(t)
	objDir := filepath.Join(bare, "objects", "00")
	if err := os.MkdirAll(objDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(t.TempDir(), "gone"), filepath.Join(objDir, strings.Repeat("0", 38))); err != nil {
		t.Fatal(err)
	}
	dest := filepath.Join(t.TempDir(), "ws")
	if err := Clone(context.Background(), CloneOptions{Origin: bare, Sha: first, Dest: dest}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dest, "a.txt")); string(b) != "one\n" {
		t.Fatalf("checked out %q", b)
	}
}

// TestCloneDuringConcurrentGC: git maintenance in the source repository
// (gc packing and deleting the loose objects of a large commit) while the
// sandbox clones it must not fail the clone.
func TestCloneDuringConcurrentGC(t *testing.T) {
	root := t.TempDir()
	src := filepath.Join(root, "src")
	testutil.Git(t, root, "init", "-q", "-b", "main", src)
	for round := range 1 {
		// A large commit leaves thousands of loose objects.
		for i := range 600 {
			dir := filepath.Join(src, fmt.Sprint("d", i%30))
			os.MkdirAll(dir, 0o755)
			os.WriteFile(filepath.Join(dir, fmt.Sprint("f", i)), []byte(fmt.Sprint(round, "-", i, "\n")), 0o644)
		}
		testutil.Git(t, src, "add", ".")
		testutil.Git(t, src, "commit", "-q", "-m", fmt.Sprint("round ", round))
		sha := testutil.Git(t, src, "rev-parse", "HEAD")
		gc := exec.Command("git", "-C", src, "-c", "gc.autoDetach=false", "gc", "--quiet", "--prune=now")
		gc.Env = append(os.Environ(), "GIT_CONFIG_NOSYSTEM=1")
		if err := gc.Start(); err != nil {
			t.Fatal(err)
		}
		dest := filepath.Join(root, fmt.Sprint("ws", round))
		err := Clone(context.Background(), CloneOptions{Origin: src, Sha: sha, Branch: "main", Dest: dest})
		if gerr := gc.Wait(); gerr != nil {
			t.Fatalf("git gc: %v", gerr)
		}
		if err != nil {
			t.Fatalf("round %d: clone during gc: %v", round, err)
		}
		if b, _ := os.ReadFile(filepath.Join(dest, "d7", "f7")); string(b) != fmt.Sprint(round, "-7\n") {
			t.Fatalf("round %d: checked out %q", round, b)
		}
	}
}

// TestRunStepsBoundWhatTheRunLogKeeps: a step printing without end does
// not fill localcloud's disk through the run log.
func TestRunStepsBoundWhatTheRunLogKeeps(t *testing.T) {
	var log bytes.Buffer
	err := RunSteps(context.Background(), []Step{{Key: "flood", Run: "head -c " + strconv.Itoa(MaxStepLogBytes+(4<<20)) + " /dev/zero; echo; echo last"}}, t.TempDir(), []string{"PATH=/usr/bin:/bin"}, &log)
	if err != nil {
		t.Fatal(err)
	}
	if log.Len() > MaxStepLogBytes+4096 {
		t.Fatalf("the run log took %d bytes of one step's output, want at most %d", log.Len(), MaxStepLogBytes)
	}
	if !strings.Contains(log.String(), "is not logged") {
		t.Fatalf("the log does not say output was dropped: %q", log.String()[log.Len()-200:])
	}
}

// TestRunStepsLeadTheirOwnSession: a setup step leads its own
// session, so it never has the terminal localcloud was started from.
func TestRunStepsLeadTheirOwnSession(t *testing.T) {
	dir := t.TempDir()
	err := RunSteps(context.Background(), []Step{{Key: "sid", Run: `set -- $(sed 's/^.*) //' /proc/$$/stat); echo "$$ $4" > sid`}}, dir, []string{"PATH=/usr/bin:/bin"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(filepath.Join(dir, "sid"))
	f := strings.Fields(string(b))
	if len(f) != 2 || f[0] != f[1] {
		t.Fatalf("pid and session of the step: %q, want the step to lead its session", b)
	}
}

func TestParseConfigReadsTaskEnvAndStepsGetIt(t *testing.T) {
	d, err := ParseConfig([]byte(`
tasks:
  - key: setup
    run: echo "$A-$B" > out
    env:
      A: one
  - key: sandbox
    run: rwx-sandbox
    env:
      PATH: /opt/x/bin:/usr/bin:/bin
      SECRET:
        value: s3
        cache-key: excluded
`))
	if err != nil {
		t.Fatal(err)
	}
	if d.Env["PATH"] != "/opt/x/bin:/usr/bin:/bin" || d.Env["SECRET"] != "s3" || len(d.Env) != 2 {
		t.Fatalf("sandbox env = %v", d.Env)
	}
	dir := t.TempDir()
	if err := RunSteps(context.Background(), d.Steps, dir, []string{"PATH=/usr/bin:/bin", "A=base", "B=two"}, nil); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "out")); string(b) != "one-two\n" {
		t.Fatalf("the step's env must override the base: %q", b)
	}
	for _, bad := range []string{"1A: x", "A-B: x", "A: {cache-key: excluded}"} {
		_, err := ParseConfig([]byte("tasks:\n  - key: sandbox\n    run: rwx-sandbox\n    env:\n      " + bad + "\n"))
		if err == nil {
			t.Errorf("env %q: accepted", bad)
		}
	}
}

func TestWithEnvReplacesEachNameOnce(t *testing.T) {
	got := WithEnv([]string{"PATH=/bin", "HOME=/h", "X=1"}, map[string]string{"PATH": "/a:/bin", "Y": "2"})
	want := []string{"HOME=/h", "X=1", "PATH=/a:/bin", "Y=2"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("WithEnv = %v, want %v", got, want)
	}
}

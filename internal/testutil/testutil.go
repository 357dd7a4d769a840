// Package testutil holds what the packages' tests share: a buffer a process
// writes while the test reads it, git for test repositories, listeners that
// answer garbage, the binaries built once per test binary, and the rules
// for tools a test needs (a missing one fails the test under CI) and for
// the long forms of the suites (make test-long).
//
// It is imported by tests only.
package testutil

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// LockedBuffer is a bytes.Buffer a process (or goroutine) may write while
// the test reads it.
type LockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *LockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String is what was written so far.
func (l *LockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Bytes is a copy of what was written so far.
func (l *LockedBuffer) Bytes() []byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	return bytes.Clone(l.b.Bytes())
}

// Len is the number of bytes written so far.
func (l *LockedBuffer) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Len()
}

// Reset empties the buffer.
func (l *LockedBuffer) Reset() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b.Reset()
}

// GitEnv is the environment Git runs in: this process's, without the
// machine's or the user's git configuration, with an author (unless the
// test set one).
func GitEnv() []string {
	env := append(os.Environ(), "GIT_CONFIG_NOSYSTEM=1", "GIT_CONFIG_GLOBAL=/dev/null")
	for _, kv := range []string{"GIT_AUTHOR_NAME=t", "GIT_AUTHOR_EMAIL=t@example.com", "GIT_COMMITTER_NAME=t", "GIT_COMMITTER_EMAIL=t@example.com"} {
		if k, _, _ := strings.Cut(kv, "="); os.Getenv(k) == "" {
			env = append(env, kv)
		}
	}
	return env
}

// Git runs git in dir (GitEnv) and returns its standard output, trimmed;
// it fails the test, with git's standard error, if git fails.
func Git(t testing.TB, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	cmd.Env = GitEnv()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("git %s in %s: %v\n%s", strings.Join(args, " "), dir, err, stderr.String())
	}
	return strings.TrimSpace(string(out))
}

// GarbageListener listens on a loopback port and answers every connection
// with reply, then closes it: a server that speaks no protocol the client
// expects. It returns the address; the listener closes with the test.
func GarbageListener(t testing.TB, reply string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen on a loopback port: %v", err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte(reply))
			c.Close()
		}
	}()
	return ln.Addr().String()
}

// ClosedAddr is a loopback address nothing listens on (a port that was
// just free: another process may take it, which the caller's test must
// tolerate or not use).
func ClosedAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen on a loopback port: %v", err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// InCI reports whether the tests run under CI (CI=true), where every tool
// a test needs is installed (.ci/run does it).
func InCI() bool { return os.Getenv("CI") == "true" }

// Long reports whether the long forms of the suites run (make test-long,
// SANDBOXD_TEST_LONG set); make test runs their short forms.
func Long() bool { return os.Getenv("SANDBOXD_TEST_LONG") != "" }

// NeedTool returns the path of an external program a test drives, or skips
// the test saying how to get it (install: "apt-get install PKG"); under CI
// a missing tool fails the test instead.
func NeedTool(t testing.TB, name, install string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err == nil {
		return p
	}
	MissingTool(t, name, install)
	return ""
}

// MissingTool skips the test for a tool that is not installed, or fails it
// under CI, whose set-up must provide it.
func MissingTool(t testing.TB, name, install string) {
	t.Helper()
	Unavailable(t, name+" is not installed", install+"; .ci/run installs it")
}

// Unavailable skips the test for a feature of the machine it needs (what
// is missing, how to get it), or fails it under CI, whose machine (root,
// writable cgroups, .ci/run's packages) must provide it.
func Unavailable(t testing.TB, what, how string) {
	t.Helper()
	msg := what + " (" + how + ")"
	if InCI() {
		t.Fatalf("%s, and CI=true: the test set-up must provide it", msg)
	}
	t.Skip("skipped: " + msg)
}

// builds are the binaries built by this test binary, by package list.
var builds struct {
	mu   sync.Mutex
	dirs map[string]*build
}

type build struct {
	once sync.Once
	dir  string
	err  error
}

// Prebuilt names the variables of the directories where make test builds
// every binary once for the whole run (plain and race-built): the packages
// that need binaries take them from there instead of each building its own.
const (
	PrebuiltEnv     = "SANDBOXD_TEST_BIN"
	PrebuiltRaceEnv = "SANDBOXD_TEST_BIN_RACE"
)

// Binaries builds the main packages pkgs (import paths) into a directory
// once per test binary and returns it; race builds them with the race
// detector. The directory is removed by Cleanup (call it from TestMain).
// Binaries that make test built already (PrebuiltEnv, PrebuiltRaceEnv)
// are taken from where it built them.
func Binaries(race bool, pkgs ...string) (string, error) {
	if dir := prebuilt(race, pkgs); dir != "" {
		return dir, nil
	}
	key := fmt.Sprint(race, pkgs)
	builds.mu.Lock()
	if builds.dirs == nil {
		builds.dirs = map[string]*build{}
	}
	b := builds.dirs[key]
	if b == nil {
		b = &build{}
		builds.dirs[key] = b
	}
	builds.mu.Unlock()
	b.once.Do(func() {
		dir, err := os.MkdirTemp("", "nooktest-bin")
		if err != nil {
			b.err = fmt.Errorf("make a directory for the test binaries: %w", err)
			return
		}
		args := []string{"build", "-o", dir}
		if race {
			args = append(args, "-race")
		}
		cmd := exec.Command("go", append(args, pkgs...)...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			os.RemoveAll(dir)
			b.err = fmt.Errorf("go build %s: %w\n%s", strings.Join(pkgs, " "), err, out)
			return
		}
		b.dir = dir
	})
	return b.dir, b.err
}

// prebuilt is the directory make test built every one of pkgs into, if
// it did.
func prebuilt(race bool, pkgs []string) string {
	dir := os.Getenv(PrebuiltEnv)
	if race {
		dir = os.Getenv(PrebuiltRaceEnv)
	}
	if dir == "" {
		return ""
	}
	for _, p := range pkgs {
		if st, err := os.Stat(filepath.Join(dir, path.Base(p))); err != nil || st.Mode()&0o111 == 0 {
			return ""
		}
	}
	return dir
}

// Cleanup removes the directories Binaries built into.
func Cleanup() {
	builds.mu.Lock()
	defer builds.mu.Unlock()
	for _, b := range builds.dirs {
		if b.dir != "" {
			os.RemoveAll(b.dir)
		}
	}
}

// Binary is the main package pkg (an import path) built by Binaries
// (without the race detector), by its file name; it fails the test if the
// build failed.
func Binary(t testing.TB, pkg string) string {
	t.Helper()
	dir, err := Binaries(false, pkg)
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(dir, path.Base(pkg))
}

// RaceEnv is the GORACE setting for race-built processes a test starts:
// the user's, with no sleep at exit. The race runtime sleeps a second at
// every exit by default (atexit_sleep_ms) so that other threads can finish
// a report; tests start and stop hundreds of such processes, and a report
// is still written by the thread that finds the race.
func RaceEnv() string {
	return strings.TrimSpace("GORACE=" + os.Getenv("GORACE") + " atexit_sleep_ms=0")
}

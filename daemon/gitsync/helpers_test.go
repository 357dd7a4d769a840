package gitsync

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/sandboxd/sandboxd/internal/helperproto"
	"github.com/sandboxd/sandboxd/internal/testutil"
	"github.com/sandboxd/sandboxd/internal/watch"
)

// isolate points HOME and XDG_* at temp dirs and gives git a fixed identity,
// so tests read no user config and write nothing outside their dirs.
func isolate(t testing.TB) {
	t.Helper()
	home := t.TempDir()
	t.Setenv("HOME", home)
	t.Setenv("XDG_CONFIG_HOME", filepath.Join(home, ".config"))
	t.Setenv("XDG_STATE_HOME", filepath.Join(home, ".state"))
	t.Setenv("XDG_DATA_HOME", filepath.Join(home, ".data"))
	t.Setenv("XDG_RUNTIME_DIR", filepath.Join(home, ".run"))
	t.Setenv("XDG_CACHE_HOME", filepath.Join(home, ".cache"))
	// The sandbox helper's holder, which would use the machine's /dev/shm.
	t.Setenv("SANDBOXD_HOLD_ROOT", filepath.Join(home, ".hold"))
	t.Setenv("GIT_CONFIG_NOSYSTEM", "1")
	t.Setenv("GIT_AUTHOR_NAME", "Test")
	t.Setenv("GIT_AUTHOR_EMAIL", "test@example.com")
	t.Setenv("GIT_COMMITTER_NAME", "Test")
	t.Setenv("GIT_COMMITTER_EMAIL", "test@example.com")
	for _, v := range gitEnvOverrides {
		t.Setenv(v, "")
		os.Unsetenv(v)
	}
}

// newTrackedSyncer is a Syncer with a working tree tracker whose every
// incremental patch is checked against a full scan: a stale change set
// fails the test that made it.
func newTrackedSyncer(t testing.TB, o Options) *Syncer {
	t.Helper()
	trees := watch.NewTrees(watch.TreesOptions{})
	t.Cleanup(func() { _ = trees.Close() })
	o.Changes = trees
	s := New(o)
	s.verify = true
	s.observe = func(how string) { t.Logf("prepare: %s", how) }
	return s
}

// sandboxRunner runs commands with /bin/sh -c in the sandbox checkout, as
// the agent does, counting them.
type sandboxRunner struct {
	dir string
	// helperName and helperInstance: the helper serving (startHelper).
	helperName, helperInstance string
	mu                         sync.Mutex
	log                        []string
}

func (r *sandboxRunner) Run(ctx context.Context, command string, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	r.mu.Lock()
	r.log = append(r.log, command)
	r.mu.Unlock()
	cmd := exec.CommandContext(ctx, "/bin/sh", "-c", command)
	cmd.Dir = r.dir
	cmd.Stdout, cmd.Stderr = stdout, stderr
	err := runWithStdin(cmd, stdin)
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode(), nil
	}
	if err != nil {
		return -1, err
	}
	return 0, nil
}

// runWithStdin runs cmd with stdin copied in a goroutine nobody waits for,
// as sshpool does: a reader that outlives the process holds nothing.
func runWithStdin(cmd *exec.Cmd, stdin io.Reader) error {
	if stdin == nil {
		return cmd.Run()
	}
	w, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	go func() {
		_, _ = io.Copy(w, stdin)
		_ = w.Close()
	}()
	return cmd.Wait()
}

func (r *sandboxRunner) calls() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.log)
}

func (r *sandboxRunner) reset() {
	r.mu.Lock()
	r.log = nil
	r.mu.Unlock()
}

// fixture is a local clone, its origin, and a sandbox clone of origin
// checked out at the base commit.
type fixture struct {
	t       *testing.T
	local   string
	origin  string
	sandbox string
	base    string
	s       *Syncer
	r       *sandboxRunner
	// compareTrees: syncCompare checks the sandbox's tree.
	compareTrees bool
	// finishCalls are the Runner calls fused lets Finish make (1 to copy a
	// pull over the limit); none by default.
	finishCalls int
}

// newFixture commits files in a new local repository, publishes it to a
// bare origin and clones the sandbox from there.
func newFixture(t *testing.T, files map[string]string) *fixture {
	t.Helper()
	isolate(t)
	root := t.TempDir()
	f := &fixture{t: t, local: filepath.Join(root, "local"), origin: filepath.Join(root, "origin.git"), sandbox: filepath.Join(root, "sandbox")}
	testutil.Git(t, root, "init", "-q", "-b", "main", f.local)
	writeFiles(t, f.local, files)
	testutil.Git(t, f.local, "add", "-A")
	testutil.Git(t, f.local, "commit", "-q", "-m", "base")
	testutil.Git(t, root, "clone", "-q", "--bare", f.local, f.origin)
	testutil.Git(t, f.local, "remote", "add", "origin", f.origin)
	testutil.Git(t, f.local, "fetch", "-q", "origin")
	testutil.Git(t, root, "clone", "-q", f.origin, f.sandbox)
	f.base = strings.TrimSpace(testutil.Git(t, f.local, "rev-parse", "HEAD"))
	f.s = newTrackedSyncer(t, Options{})
	if largeTree {
		f.s.largeIndex = 1
	}
	f.r = &sandboxRunner{dir: f.sandbox}
	if useHelper {
		f.r.startHelper(t)
	}
	f.compareTrees = true
	return f
}

// push prepares and pushes, in one Runner call.
func (f *fixture) push() *Patch {
	f.t.Helper()
	ctx := context.Background()
	p, err := f.s.Prepare(ctx, f.local, f.base)
	if err != nil {
		f.t.Fatalf("prepare: %v", err)
	}
	p.Sandbox = "fixture"
	before := f.r.calls()
	res, err := f.s.Push(ctx, f.r, p)
	if err != nil {
		f.t.Fatalf("push: %v", err)
	}
	want := 1
	if res.Commits {
		want++ // git-receive-pack, then the normalization
	}
	if n := f.r.calls() - before; n != want {
		f.t.Fatalf("push made %d runner calls, want %d", n, want)
	}
	return p
}

// pull pulls, checking it took one Runner call and left the sandbox's
// files as the command left them (normalized before, not after).
func (f *fixture) pull() (PullResult, error) {
	f.t.Helper()
	before := f.r.calls()
	sandbox := tree(f.t, f.sandbox)
	res, err := f.s.Pull(context.Background(), f.r, f.local)
	if n := f.r.calls() - before; n != 1 {
		f.t.Fatalf("pull made %d runner calls, want 1", n)
	}
	assertTree(f.t, f.sandbox, sandbox)
	return res, err
}

// inSandbox runs the user's command in the sandbox (the caller's own exec
// request, not counted as sync).
func (f *fixture) inSandbox(command string) string {
	f.t.Helper()
	cmd := exec.Command("/bin/sh", "-c", command)
	cmd.Dir = f.sandbox
	out, err := cmd.CombinedOutput()
	if err != nil {
		f.t.Fatalf("sandbox command %q: %v: %s", command, err, out)
	}
	return string(out)
}

// exec is one synced exec as the daemon runs it: one fused exchange (push,
// command, pull in one Runner call), checking the pull left the sandbox's
// files as the command left them.
func (f *fixture) exec(command string) (string, PullResult, error) {
	f.t.Helper()
	out, fr, err := f.fused(command)
	if err != nil {
		f.t.Fatalf("fused exec %q: %v", command, err)
	}
	if !fr.Ran {
		f.t.Fatalf("fused exec %q: the command did not run", command)
	}
	return out, fr.Pull, fr.PullErr
}

// fused runs command synced as the daemon does: one exchange with the
// helper (again after an exchange that found something to do first), or,
// without a helper (or when it did not take the exchange), the separate
// steps. It returns the command's output (stdout, then stderr). It checks
// an exchange took one Runner call, plus one when commits were pushed, and
// Finish f.finishCalls.
func (f *fixture) fused(command string) (string, Fused, error) {
	f.t.Helper()
	return f.fusedAfter(command, nil)
}

// fusedAfter is fused with before called on each exchange once it is
// made, before it runs.
func (f *fixture) fusedAfter(command string, before func(*Exchange)) (string, Fused, error) {
	f.t.Helper()
	ctx := context.Background()
	for attempt := 0; attempt < 3; attempt++ {
		p, err := f.s.PrepareExchange(ctx, f.r, f.local, f.base)
		if err != nil {
			f.t.Fatalf("prepare: %v", err)
		}
		p.Sandbox = "fixture"
		f.r.reset()
		x, ok, err := f.s.Fuse(ctx, f.r, p, command)
		if err != nil {
			return "", Fused{}, err
		}
		if !ok {
			return f.split(command)
		}
		if before != nil {
			before(x)
		}
		var stdout, stderr bytes.Buffer
		runErr := x.Run(ctx, f.r, ExchangeIO{Stdout: &stdout, Stderr: &stderr})
		var sandbox map[string]string
		if x.Started() {
			sandbox = tree(f.t, f.sandbox)
		}
		before := f.r.calls()
		fr, err := x.Finish(ctx, f.r)
		if err != nil {
			return stdout.String() + stderr.String(), fr, err
		}
		if runErr != nil {
			f.t.Fatalf("run the exchange: %v", runErr)
		}
		if fr.Split {
			return f.split(command)
		}
		if fr.Again {
			againExchanges.Add(1)
			continue
		}
		if fr.Native {
			nativeExecs.Add(1)
		}
		want := 1
		if fr.Push.Commits {
			want++
		}
		if n := before; n != want {
			f.t.Fatalf("a fused exec made %d runner calls, want %d", n, want)
		}
		if n := f.r.calls() - before; n != f.finishCalls {
			f.t.Fatalf("finishing a fused exec made %d more runner calls, want %d", n, f.finishCalls)
		}
		assertTree(f.t, f.sandbox, sandbox)
		return stdout.String() + stderr.String(), fr, nil
	}
	f.t.Fatalf("fused exec %q: the exchange kept finding work to do first", command)
	return "", Fused{}, nil
}

// split runs command synced by the separate steps, as the daemon does
// without a helper: push (again after it brought edits back), the
// command, pull; each its own Runner call.
func (f *fixture) split(command string) (string, Fused, error) {
	f.t.Helper()
	ctx := context.Background()
	var fr Fused
	for attempt := 0; ; attempt++ {
		p, err := f.s.Prepare(ctx, f.local, f.base)
		if err != nil {
			f.t.Fatalf("prepare: %v", err)
		}
		p.Sandbox = "fixture"
		res, err := f.s.Push(ctx, f.r, p)
		fr.Push.Recovered, fr.Push.Commits = res.Recovered, fr.Push.Commits || res.Commits
		if err != nil {
			return "", fr, err
		}
		if !res.Again {
			break
		}
		if attempt > 0 {
			return "", fr, errors.New("the push kept finding edits")
		}
	}
	var out bytes.Buffer
	code, err := f.r.Run(ctx, command, nil, &out, &out)
	if err != nil {
		f.t.Fatalf("run the command: %v", err)
	}
	sandbox := tree(f.t, f.sandbox)
	fr.Ran, fr.ExitCode = true, code
	fr.Pull, fr.PullErr = f.s.Pull(ctx, f.r, f.local)
	assertTree(f.t, f.sandbox, sandbox)
	return out.String(), fr, nil
}

// assertSandboxClean checks the sandbox is at rest: tree == HEAD == base,
// both sync refs at base.
func (f *fixture) assertSandboxClean() {
	f.t.Helper()
	if st := testutil.Git(f.t, f.sandbox, "status", "--porcelain", "--untracked-files=all"); st != "" {
		f.t.Fatalf("sandbox not clean after sync:\n%s", st)
	}
	head := strings.TrimSpace(testutil.Git(f.t, f.sandbox, "rev-parse", "HEAD"))
	for _, ref := range []string{SnapshotRef, BaseRef} {
		if got := strings.TrimSpace(testutil.Git(f.t, f.sandbox, "rev-parse", ref)); got != head {
			f.t.Fatalf("%s = %s, want HEAD %s", ref, got, head)
		}
	}
}

func writeFiles(t testing.TB, dir string, files map[string]string) {
	t.Helper()
	for name, content := range files {
		writeFile(t, filepath.Join(dir, name), content)
	}
}

func writeFile(t testing.TB, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// tree maps every path of a working tree outside .git to its type, mode
// and content (a symlink's target), to compare trees byte for byte.
func tree(t testing.TB, root string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == ".git" {
			return filepath.SkipDir
		}
		if d.IsDir() {
			return nil
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		if fi.Mode()&os.ModeSymlink != 0 {
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			out[rel] = "link:" + target
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		out[rel] = fi.Mode().Perm().String() + ":" + string(b)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// assertTree compares a tree with want, byte for byte.
func assertTree(t testing.TB, root string, want map[string]string) {
	t.Helper()
	got := tree(t, root)
	var diffs []string
	for k, v := range want {
		if g, ok := got[k]; !ok {
			diffs = append(diffs, "missing "+k)
		} else if g != v {
			diffs = append(diffs, k+": got "+quoteShort(g)+", want "+quoteShort(v))
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			diffs = append(diffs, "unexpected "+k)
		}
	}
	if len(diffs) > 0 {
		sort.Strings(diffs)
		t.Fatalf("tree %s differs:\n  %s", root, strings.Join(diffs, "\n  "))
	}
}

// withFiles returns a copy of tree with the given regular files (mode
// rw-r--r--) set.
func withFiles(tr map[string]string, files map[string]string) map[string]string {
	out := make(map[string]string, len(tr)+len(files))
	for k, v := range tr {
		out[k] = v
	}
	for k, v := range files {
		out[k] = "-rw-r--r--:" + v
	}
	return out
}

func quoteShort(s string) string {
	if len(s) > 80 {
		s = s[:80] + "..."
	}
	return `"` + strings.ReplaceAll(s, "\n", `\n`) + `"`
}

func fileBytes(t testing.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func randomBytes(n int, seed byte) string {
	b := make([]byte, n)
	x := uint32(seed) + 1
	for i := range b {
		x = x*1664525 + 1013904223
		b[i] = byte(x >> 24)
	}
	return string(b)
}

// useHelper makes newFixture start the helper (TestScenariosWithTheSandboxHelper).
var useHelper bool

// nativeExecs counts the fused execs the helper's native sync took part in.
var nativeExecs atomic.Int64

// againExchanges counts the exchanges that ended asking for another
// (Fused.Again) before one ran the command.
var againExchanges atomic.Int64

// largeTree makes newFixture's syncer treat every tree as large
// (TestScenariosAsALargeTree).
var largeTree bool

// syncScenarios are the sync's scenarios that run again under other
// conditions (the sandbox helper, a large tree).
func syncScenarios() map[string]func(*testing.T) {
	return map[string]func(*testing.T){
		"parity local changes":  TestParityLocalChangesSeenInSandbox,
		"parity sandbox edits":  TestParitySandboxEditsComeBack,
		"deleted local file":    TestParityDeletedLocalFileDoesNotComeBack,
		"binary":                TestBinaryBothWays,
		"rename":                TestRenameBothWays,
		"deletion":              TestDeletionBothWays,
		"mode":                  TestModeChangeBothWays,
		"hostile names":         TestHostileNamesBothWays,
		"conflict":              TestConflictThreeWay,
		"unpulled edits":        TestUnpulledEditsComeBackBeforeTheNextPush,
		"generated files":       TestGeneratedFilesStayDeletedDoNotComeBack,
		"ignored files":         TestIgnoredFiles,
		"heal":                  TestPushHealsChangesBetweenExecs,
		"fused killed":          TestExchangeCommandKilledBySignalIsStillPulled,
		"fused unpulled":        TestFusedBringsBackUnpulledEditsFirst,
		"fused ignored in way":  TestFusedPushReplacesAnIgnoredFileInTheWay,
		"delete and create":     TestConflictDeleteAndCreate,
		"missing base":          TestSandboxMissingBaseCommitIsPushed,
		"no changes":            TestNoChanges,
		"pulled not acked":      TestPulledButNotAcknowledged,
		"subdirectory":          TestSyncFromSubdirectoryPath,
		"unpushed commits":      TestParityUnpushedCommitAndUncommittedFile,
		"revert":                TestRevertAlone,
		"pull transfer broken":  TestPullTransferBrokenRecovers,
		"fused output":          TestExchangeOutputPassesThroughExactly,
		"fused push failure":    TestFusedPushFailureRunsNothing,
		"fused damaged trailer": TestExchangeDamagedPullIsFetchedAgain,
	}
}

// The sync's scenarios again with every tree counted as large: the
// sandbox's working tree moves to the pushed tree by a patch of what
// differs (git apply --index) instead of a two-way read-tree, with the
// same outcome in every scenario.
func TestScenariosAsALargeTree(t *testing.T) {
	for name, test := range syncScenarios() {
		for _, helper := range []bool{false, true} {
			if helper && runtime.GOOS != "linux" {
				continue
			}
			t.Run(fmt.Sprintf("%s/helper=%v", name, helper), func(t *testing.T) {
				largeTree, useHelper = true, helper
				t.Cleanup(func() { largeTree, useHelper = false, false })
				test(t)
			})
		}
	}
}

// TestMain removes the helper binary built for the package's tests.
func TestMain(m *testing.M) {
	code := m.Run()
	testutil.Cleanup()
	os.Exit(code)
}

// helperBinary builds sandboxd-helper once for the package's tests.
func helperBinary(t *testing.T) string {
	t.Helper()
	return testutil.Binary(t, "github.com/sandboxd/sandboxd/cmd/sandboxd-helper")
}

// startHelper installs the helper in the sandbox and runs its server for
// the test; the runner then offers it to the scripts.
func (r *sandboxRunner) startHelper(t *testing.T) {
	t.Helper()
	state := filepath.Join(r.dir, ".git", "sandboxd")
	name := helperproto.Name + "-0123456789abcdef"
	b, err := os.ReadFile(helperBinary(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(state, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(state, "bin", name), b, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(state, "bin", name), "serve", "-state", state)
	cmd.Dir = r.dir
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// The server outlives its stdin (a managed process): TERM ends it.
		_ = cmd.Process.Signal(syscall.SIGTERM)
		stdin.Close()
		_ = cmd.Wait()
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("the helper did not answer: %v", err)
	}
	r.helperName, r.helperInstance = name, strings.TrimSpace(strings.TrimPrefix(line, helperproto.Ready))
}

// SyncHelper offers the helper when startHelper ran (HelperRunner).
func (r *sandboxRunner) SyncHelper() (string, string) { return r.helperName, r.helperInstance }

// patchesComputed waits until the patches behind f's early requests are
// computed (each holds its repository's prepState until then).
func (f *fixture) patchesComputed() {
	f.s.mu.Lock()
	var sts []*prepState
	for _, st := range f.s.prep {
		sts = append(sts, st)
	}
	f.s.mu.Unlock()
	for _, st := range sts {
		st.mu.Lock()
		//lint:ignore SA2001 a wait for the holder, not a critical section
		st.mu.Unlock()
	}
}

//go:build linux

package sandboxhelper

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/sandboxhelper/hold"
)

// isolate keeps git and the test away from the real user's state.
func isolate(t *testing.T) {
	t.Helper()
	home := t.TempDir()
	t.Setenv("HOME", home)
	for _, v := range []string{"XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_RUNTIME_DIR"} {
		t.Setenv(v, filepath.Join(home, v))
	}
	// The holder, which would use the machine's /dev/shm.
	t.Setenv(hold.RootEnv, filepath.Join(home, "hold"))
	t.Setenv("GIT_CONFIG_NOSYSTEM", "1")
	for _, v := range []string{"GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME"} {
		t.Setenv(v, "t")
	}
	for _, v := range []string{"GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL"} {
		t.Setenv(v, "t@example.com")
	}
}

func run(t *testing.T, dir string, env []string, args ...string) string {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

func write(t *testing.T, p, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// fixture is a checkout with a sync index, a running server and the
// options of Stage for it.
type fixture struct {
	root, state string
	oracleIndex string
	o           StageOptions
	stop        func()
}

// newFixture makes a committed repository (a deep path, so the socket is
// reached through /proc) and starts a server on it.
func newFixture(t *testing.T) *fixture {
	t.Helper()
	isolate(t)
	root := filepath.Join(t.TempDir(), strings.Repeat("deep-directory-", 6), "repo")
	for i := range 30 {
		write(t, filepath.Join(root, fmt.Sprintf("d%d/e%d/f%d.txt", i%3, i%5, i)), fmt.Sprintf("file %d\n", i))
	}
	write(t, filepath.Join(root, ".gitignore"), "*.log\nbuild/\n")
	run(t, root, nil, "init", "-q", "-b", "main")
	run(t, root, nil, "add", "-A")
	run(t, root, nil, "commit", "-q", "-m", "base")
	state := filepath.Join(root, ".git", "sandboxd")
	if err := os.MkdirAll(state, 0o755); err != nil {
		t.Fatal(err)
	}
	index := filepath.Join(state, "index")
	b, err := os.ReadFile(filepath.Join(root, ".git", "index"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(index, b, 0o644); err != nil {
		t.Fatal(err)
	}
	f := &fixture{root: root, state: state, oracleIndex: filepath.Join(t.TempDir(), "oracle")}
	if err := os.WriteFile(f.oracleIndex, b, 0o644); err != nil {
		t.Fatal(err)
	}
	f.o = StageOptions{Root: root, State: state, Index: index}
	f.start(t)
	t.Cleanup(func() { f.stop() })
	return f
}

// start runs a server, as the daemon does, and waits for its ready line.
func (f *fixture) start(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, f.root, f.state, pw, nil) }()
	line, err := bufio.NewReader(pr).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	f.o.Instance = strings.TrimSpace(strings.TrimPrefix(line, Ready))
	f.stop = func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
		pw.Close()
		f.stop = func() {}
	}
}

// oracle is the tree git add -A makes of the working tree, on an index of
// its own that went through the same stages (a tracked file stays tracked
// when an ignore rule comes to match it).
func (f *fixture) oracle(t *testing.T) string {
	t.Helper()
	env := []string{"GIT_INDEX_FILE=" + f.oracleIndex}
	run(t, f.root, env, "add", "-A")
	return run(t, f.root, env, "write-tree")
}

func (f *fixture) stage(t *testing.T) Result {
	t.Helper()
	o := f.o
	o.PrintTree = true
	res, err := Stage(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// Whatever happens to the working tree, the sync index staged by the
// helper is the one git add -A makes, and after the first stage it gets
// there looking only at what changed.
func TestStageMatchesAddAll(t *testing.T) {
	f := newFixture(t)
	if res := f.stage(t); !res.Full {
		t.Fatal("the first stage after a server started was not full")
	}
	rng := rand.New(rand.NewSource(7))
	p := func(rel string) string { return filepath.Join(f.root, rel) }
	ops := []func(i int){
		func(i int) {
			write(t, p(fmt.Sprintf("d%d/e%d/f%d.txt", i%3, i%5, rng.Intn(30))), fmt.Sprintf("edit %d\n", i))
		},
		func(i int) { write(t, p(fmt.Sprintf("new%d/sub/n%d.txt", i%4, i)), "new\n") },
		func(i int) { _ = os.Remove(p(fmt.Sprintf("d%d/e%d/f%d.txt", i%3, i%5, rng.Intn(30)))) },
		func(i int) { write(t, p(fmt.Sprintf("d1/x%d.log", i)), "ignored\n") },
		func(i int) { write(t, p(fmt.Sprintf("build/out%d/o.bin", i)), "ignored\n") },
		func(i int) { _ = os.RemoveAll(p(fmt.Sprintf("new%d", i%4))) },
		func(i int) { _ = os.Rename(p(fmt.Sprintf("d%d", i%3)), p(fmt.Sprintf("moved%d", i))) },
		func(i int) { _ = os.Rename(p(fmt.Sprintf("moved%d", i-1)), p(fmt.Sprintf("d%d", (i-1)%3))) },
		func(i int) { _ = os.Chmod(p(fmt.Sprintf("d2/e%d/f%d.txt", i%5, rng.Intn(30))), 0o755) },
		func(i int) { _ = os.Symlink("../target", p(fmt.Sprintf("d0/link%d", i))) },
		func(i int) {
			// A file becomes a directory.
			_ = os.Remove(p("d0/e0/f0.txt"))
			write(t, p(fmt.Sprintf("d0/e0/f0.txt/inner%d", i)), "x\n")
		},
		func(i int) {
			write(t, p(fmt.Sprintf("tmp%d", i)), "gone soon\n")
			_ = os.Remove(p(fmt.Sprintf("tmp%d", i)))
		},
	}
	restricted := 0
	for i := 1; i <= 60; i++ {
		for range 1 + rng.Intn(3) {
			ops[rng.Intn(len(ops))](i)
		}
		if i%20 == 0 {
			// A rule that changes what the other paths are.
			write(t, p(".gitignore"), fmt.Sprintf("*.log\nbuild/\nd%d/\n", i%3))
		}
		res := f.stage(t)
		if want := f.oracle(t); res.Tree != want {
			t.Fatalf("round %d: the helper staged tree %s, git add -A makes %s (full=%v)", i, res.Tree, want, res.Full)
		}
		if !res.Full {
			restricted++
		}
	}
	if restricted < 50 {
		t.Fatalf("only %d of 60 stages looked at the changed paths alone", restricted)
	}
}

// Whenever the helper cannot vouch for the paths it did not look at, the
// whole tree is staged: a first question to a new server, a marker of
// another server, an index the scripts rewrote, a server that went away.
func TestStageFallsBackWhenUnsure(t *testing.T) {
	f := newFixture(t)
	f.stage(t)
	if res := f.stage(t); res.Full {
		t.Fatal("nothing changed, yet the whole tree was staged")
	}
	// Another server's marker (another daemon staged in between).
	if err := os.WriteFile(f.o.Index+".fast", []byte("0123456789abcdef\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if res := f.stage(t); !res.Full {
		t.Fatal("a marker of another server was trusted")
	}
	// The scripts rewrote the index their own way and removed the marker.
	if err := os.Remove(f.o.Index + ".fast"); err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(f.root, "d0/late.txt"), "late\n")
	if res := f.stage(t); !res.Full || res.Tree != f.oracle(t) {
		t.Fatalf("without a marker: full=%v tree ok=%v", res.Full, res.Tree == f.oracle(t))
	}
	// The index itself went away (the marker stayed): the whole tree.
	f.stage(t)
	if err := os.Remove(f.o.Index); err != nil {
		t.Fatal(err)
	}
	if res := f.stage(t); !res.Full || res.Tree != f.oracle(t) {
		t.Fatalf("without an index: full=%v", res.Full)
	}
	// The server goes away: the whole tree, and no marker is left to trust.
	f.stop()
	write(t, filepath.Join(f.root, "d0/later.txt"), "later\n")
	res := f.stage(t)
	if !res.Full || res.Tree != f.oracle(t) {
		t.Fatalf("without a server: full=%v", res.Full)
	}
	if _, err := os.Stat(f.o.Index + ".fast"); err == nil {
		t.Fatal("a marker was written without a server's answer")
	}
	// A new server: its first answer is full, then it looks at changes.
	f.start(t)
	if res := f.stage(t); !res.Full {
		t.Fatal("the first stage with a new server was not full")
	}
	write(t, filepath.Join(f.root, "d1/again.txt"), "again\n")
	if res := f.stage(t); res.Full || res.Staged != 1 || res.Tree != f.oracle(t) {
		t.Fatalf("after the new server's first stage: %+v", res)
	}
}

// The tree of a staged index is remembered, so the next stage with
// nothing changed needs no git; the user's index is reset to head only when
// it is not as the helper left it.
func TestStageRemembersTreesAndTheUserIndex(t *testing.T) {
	f := newFixture(t)
	head := run(t, f.root, nil, "rev-parse", "HEAD")
	o := f.o
	o.PrintTree, o.Head, o.Real = true, head, filepath.Join(f.root, ".git", "index")
	res, err := Stage(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	// A wrong tree in the cache of an index nothing touched is what the
	// next stage says: the cache is trusted, so a test can see it used.
	rememberTree(o.Index+".tree", o.Index, strings.Repeat("ab", 20))
	got, err := Stage(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if got.Tree != strings.Repeat("ab", 20) {
		t.Fatalf("the cached tree was not used: %s", got.Tree)
	}
	// Once the index changes, the cache is not used.
	write(t, filepath.Join(f.root, "d2/new.txt"), "n\n")
	got, err = Stage(context.Background(), o)
	if err != nil || got.Tree != f.oracle(t) || got.Tree == res.Tree {
		t.Fatalf("after a change: %+v %v", got, err)
	}
	// The user stages a file in their own index: the next stage resets it.
	run(t, f.root, nil, "add", "d2/new.txt")
	before, _ := stampOf(o.Real)
	time.Sleep(10 * time.Millisecond)
	if _, err := Stage(context.Background(), o); err != nil {
		t.Fatal(err)
	}
	if st := run(t, f.root, nil, "diff", "--cached", "--name-only", head); st != "" {
		t.Fatalf("the user's index was not reset to head: %q", st)
	}
	after, _ := stampOf(o.Real)
	if after == before {
		t.Fatal("the user's index was not rewritten")
	}
	// Untouched since: left alone.
	if _, err := Stage(context.Background(), o); err != nil {
		t.Fatal(err)
	}
	if again, _ := stampOf(o.Real); again != after {
		t.Fatal("an untouched user index was rewritten")
	}
}

// A submodule's checkout is a nested repository the tracker leaves out:
// with a .gitmodules file every stage looks at the whole tree, so a
// submodule moved to another commit is staged.
func TestStageWithSubmodulesLooksAtEverything(t *testing.T) {
	f := newFixture(t)
	sub := filepath.Join(t.TempDir(), "sub")
	run(t, "", nil, "init", "-q", "-b", "main", sub)
	write(t, filepath.Join(sub, "s.txt"), "one\n")
	run(t, sub, nil, "add", "-A")
	run(t, sub, nil, "commit", "-q", "-m", "one")
	run(t, f.root, nil, "-c", "protocol.file.allow=always", "submodule", "add", "-q", sub, "mod")
	f.stage(t)
	f.stage(t)
	// The submodule's checkout moves: nothing the tracker sees changes.
	write(t, filepath.Join(f.root, "mod", "s.txt"), "two\n")
	run(t, filepath.Join(f.root, "mod"), nil, "commit", "-q", "-am", "two")
	res := f.stage(t)
	if want := f.oracle(t); res.Tree != want || !res.Full {
		t.Fatalf("with a submodule: tree %s, want %s (full=%v)", res.Tree, want, res.Full)
	}
}

// Thousands of files written at once (a build into an ignored directory,
// a generator into a new one) are named by their directories: the stage
// stays restricted and stages what git add -A does.
func TestStageOfManyPathsNamesTheirDirectories(t *testing.T) {
	f := newFixture(t)
	f.stage(t)
	for i := range 3000 {
		write(t, filepath.Join(f.root, "build", fmt.Sprintf("obj%d", i%7), fmt.Sprintf("o%d.o", i)), "obj\n")
	}
	for i := range 2500 {
		write(t, filepath.Join(f.root, "gen", fmt.Sprintf("g%d", i%3), fmt.Sprintf("g%d.txt", i)), "gen\n")
	}
	write(t, filepath.Join(f.root, "d0/e0/f0.txt"), "edited\n")
	if err := os.Remove(filepath.Join(f.root, "d1/e1/f1.txt")); err != nil {
		t.Fatal(err)
	}
	res := f.stage(t)
	if want := f.oracle(t); res.Tree != want {
		t.Fatalf("tree %s, git add -A makes %s (full=%v)", res.Tree, want, res.Full)
	}
	if res.Full || res.Staged != 2502 {
		t.Fatalf("full=%v staged=%d, want a restricted stage of 2,502 paths", res.Full, res.Staged)
	}
}

func TestCollapse(t *testing.T) {
	paths := []string{"a/b/c/1", "a/b/c/2", "a/b/d/3", "a/e/4", "f"}
	for _, tc := range []struct {
		limit int
		want  string
	}{
		{5, "a/b/c/1 a/b/c/2 a/b/d/3 a/e/4 f"},
		{4, "a/b/c a/b/d a/e/4 f"},
		{3, "a/b a/e f"},
		{2, "a f"},
		{1, ""},
	} {
		if got := strings.Join(collapse(paths, tc.limit), " "); got != tc.want {
			t.Errorf("collapse to %d: %q, want %q", tc.limit, got, tc.want)
		}
	}
}

// A failed git call is named by its command, not by an option before it.
func TestGitErrorsNameTheCommand(t *testing.T) {
	_, err := git(context.Background(), t.TempDir(), filepath.Join(t.TempDir(), "index"), nil, "--no-optional-locks", "status")
	if err == nil || !strings.HasPrefix(err.Error(), "git status: ") {
		t.Fatalf("error %v, want it to start with \"git status: \"", err)
	}
}

package gitobj

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

// setupGitEnv isolates git from the user's and system's configuration and
// from any repository the test process happens to run in.
func setupGitEnv(t *testing.T) {
	t.Helper()
	testutil.NeedTool(t, "git", "apt-get install git")
	t.Setenv("HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	t.Setenv("GIT_CONFIG_NOSYSTEM", "1")
	t.Setenv("GIT_AUTHOR_NAME", "T")
	t.Setenv("GIT_AUTHOR_EMAIL", "t@example.com")
	t.Setenv("GIT_COMMITTER_NAME", "T")
	t.Setenv("GIT_COMMITTER_EMAIL", "t@example.com")
	t.Setenv("GIT_AUTHOR_DATE", "1700000000 +0000")
	t.Setenv("GIT_COMMITTER_DATE", "1700000000 +0000")
	for _, k := range []string{"GIT_DIR", "GIT_INDEX_FILE", "GIT_WORK_TREE", "GIT_OBJECT_DIRECTORY",
		"GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_CONFIG_GLOBAL", "GIT_CONFIG_PARAMETERS", "GIT_LITERAL_PATHSPECS"} {
		t.Setenv(k, "") // registers restoration
		os.Unsetenv(k)
	}
}

// testRepo is a scratch repository driven by the real git.
type testRepo struct {
	t      *testing.T
	work   string
	gitDir string
}

func newTestRepo(t *testing.T) *testRepo {
	t.Helper()
	setupGitEnv(t)
	work := t.TempDir()
	r := &testRepo{t: t, work: work, gitDir: filepath.Join(work, ".git")}
	r.git(nil, "", "init", "-q", work)
	return r
}

func (r *testRepo) open() *Store {
	r.t.Helper()
	s, err := OpenStore(r.gitDir)
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() { s.Close() })
	return s
}

// git runs git in the repository and returns its stdout; failure is fatal.
func (r *testRepo) git(env []string, stdin string, args ...string) string {
	r.t.Helper()
	out, errOut, err := r.tryGit(env, stdin, args...)
	if err != nil {
		r.t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, errOut)
	}
	return out
}

func (r *testRepo) tryGit(env []string, stdin string, args ...string) (string, string, error) {
	cmd := exec.Command("git", args...)
	cmd.Dir = r.work
	cmd.Env = append(os.Environ(), env...)
	if args[0] != "init" {
		cmd.Env = append(cmd.Env, "GIT_DIR="+r.gitDir)
	}
	cmd.Stdin = strings.NewReader(stdin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	err := cmd.Run()
	return stdout.String(), stderr.String(), err
}

func (r *testRepo) oid(s string) OID {
	r.t.Helper()
	o, err := ParseOID(strings.TrimSpace(s))
	if err != nil {
		r.t.Fatal(err)
	}
	return o
}

func (r *testRepo) blob(content string) OID {
	r.t.Helper()
	return r.oid(r.git(nil, content, "hash-object", "-w", "--stdin"))
}

// indexTree is the reference for EditTree: it applies changes one at a time
// to a fresh index loaded from base and lets git write the tree. Deleting a
// directory is expanded into deleting each of its files, the meaning
// EditTree gives to Mode 0 on a directory.
func (r *testRepo) indexTree(base OID, changes []Change) OID {
	r.t.Helper()
	env := []string{"GIT_INDEX_FILE=" + filepath.Join(r.t.TempDir(), "index"), "GIT_LITERAL_PATHSPECS=1"}
	if base.IsZero() {
		r.git(env, "", "read-tree", "--empty")
	} else {
		r.git(env, "", "read-tree", base.String())
	}
	for _, ch := range changes {
		var in strings.Builder
		if ch.Mode == 0 {
			for _, p := range strings.Split(r.git(env, "", "ls-files", "-z", "--", ch.Path), "\x00") {
				if p != "" {
					fmt.Fprintf(&in, "0 %s\t%s\x00", OID{}, p)
				}
			}
		} else {
			fmt.Fprintf(&in, "%o %s\t%s\x00", ch.Mode, ch.OID, ch.Path)
		}
		if in.Len() > 0 {
			r.git(env, in.String(), "update-index", "-z", "--index-info")
		}
	}
	return r.oid(r.git(env, "", "write-tree"))
}

// gitDiff is the reference for DiffTrees.
func (r *testRepo) gitDiff(a, b OID) []Diff {
	r.t.Helper()
	if a.IsZero() {
		a = emptyTreeOID
	}
	if b.IsZero() {
		b = emptyTreeOID
	}
	out := r.git(nil, "", "diff-tree", "-r", "--no-renames", "-z", a.String(), b.String())
	fields := strings.Split(out, "\x00")
	var diffs []Diff
	for i := 0; i+1 < len(fields); i += 2 {
		var om, nm uint32
		var oo, no, status string
		if _, err := fmt.Sscanf(fields[i], ":%o %o %s %s %s", &om, &nm, &oo, &no, &status); err != nil {
			r.t.Fatalf("parse diff-tree line %q: %v", fields[i], err)
		}
		path := fields[i+1]
		name := path[strings.LastIndexByte(path, '/')+1:]
		d := Diff{Path: path}
		if om != 0 {
			d.Old = Entry{Name: name, Mode: om, OID: r.oid(oo)}
		}
		if nm != 0 {
			d.New = Entry{Name: name, Mode: nm, OID: r.oid(no)}
		}
		diffs = append(diffs, d)
	}
	return diffs
}

// fsck runs `git fsck --strict` and fails on any complaint.
func (r *testRepo) fsck() {
	r.t.Helper()
	out, errOut, err := r.tryGit(nil, "", "fsck", "--strict", "--no-dangling")
	var complaints []string
	for _, line := range strings.Split(out+errOut, "\n") {
		if line != "" && !strings.HasPrefix(line, "notice:") {
			complaints = append(complaints, line)
		}
	}
	if err != nil || len(complaints) > 0 {
		r.t.Fatalf("git fsck --strict: %v\n%s%s", err, out, errOut)
	}
}

func ctxT(t *testing.T) context.Context { return t.Context() }

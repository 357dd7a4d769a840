package gitsync

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/sandboxd/sandboxd/errdefs"
)

// gitEnvOverrides are variables that would redirect local git away from the
// repository the daemon names (the daemon may inherit them from a hook).
var gitEnvOverrides = []string{
	"GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
	"GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_COMMON_DIR", "GIT_NAMESPACE", "GIT_PREFIX",
	"GIT_LITERAL_PATHSPECS", "GIT_GLOB_PATHSPECS", "GIT_NOGLOB_PATHSPECS", "GIT_ICASE_PATHSPECS",
}

// gitCall is one local git invocation.
type gitCall struct {
	dir   string
	index string // GIT_INDEX_FILE, when not the repository's own
	stdin io.Reader
	// stdout receives the output; when nil it is collected and returned.
	stdout io.Writer
	// literal makes pathspecs plain paths (GIT_LITERAL_PATHSPECS).
	literal bool
}

// gitError is a failed local git command with its stderr.
type gitError struct {
	args   []string
	code   int
	stderr string
	err    error
}

func (e *gitError) Error() string {
	msg := strings.TrimSpace(e.stderr)
	if msg == "" {
		msg = e.err.Error()
	}
	return fmt.Sprintf("git %s: %s", strings.Join(e.args, " "), msg)
}

func (e *gitError) Unwrap() error { return e.err }

func (s *Syncer) run(ctx context.Context, c gitCall, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, s.git, args...)
	cmd.Dir = c.dir
	cmd.Env = gitEnv(c.index)
	if c.literal {
		cmd.Env = append(cmd.Env, "GIT_LITERAL_PATHSPECS=1")
	}
	cmd.Stdin = c.stdin
	var out, errb bytes.Buffer
	if c.stdout != nil {
		cmd.Stdout = c.stdout
	} else {
		cmd.Stdout = &out
	}
	cmd.Stderr = &limitedBuffer{max: 64 << 10, buf: &errb}
	if err := cmd.Run(); err != nil {
		ge := &gitError{args: args, code: -1, stderr: errb.String(), err: err}
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			ge.code = ee.ExitCode()
		}
		return out.Bytes(), ge
	}
	return out.Bytes(), nil
}

func gitEnv(index string) []string {
	env := make([]string, 0, len(os.Environ())+1)
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		drop := false
		for _, o := range gitEnvOverrides {
			if name == o {
				drop = true
				break
			}
		}
		if !drop {
			env = append(env, kv)
		}
	}
	if index != "" {
		env = append(env, "GIT_INDEX_FILE="+index)
	}
	return env
}

// repo is a local repository as git sees it.
type repo struct {
	root   string // top level of the working tree
	gitDir string // absolute
	index  string // absolute path of its index file
}

func (s *Syncer) openRepo(ctx context.Context, dir string) (repo, error) {
	if dir == "" || !filepath.IsAbs(dir) {
		return repo{}, newError(ErrNotGitRepository, nil, "the repository path %q is not absolute", dir)
	}
	// The common case, a top level with a .git directory, needs no git
	// process; subdirectories, linked worktrees and submodules ask git.
	if fi, err := os.Stat(filepath.Join(dir, ".git")); err == nil && fi.IsDir() {
		gitDir := filepath.Join(dir, ".git")
		return repo{root: filepath.Clean(dir), gitDir: gitDir, index: filepath.Join(gitDir, "index")}, nil
	}
	out, err := s.run(ctx, gitCall{dir: dir}, "rev-parse", "--show-toplevel", "--absolute-git-dir", "--git-path", "index")
	if err != nil {
		if ctx.Err() != nil {
			return repo{}, ctx.Err()
		}
		return repo{}, newError(ErrNotGitRepository, err, "%s is not inside a git working tree (%v): run nook inside a git checkout, or use --no-sync", dir, err)
	}
	lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
	if len(lines) != 3 {
		return repo{}, newError(ErrNotGitRepository, nil, "%s: unexpected answer from git rev-parse: %q", dir, out)
	}
	r := repo{root: lines[0], gitDir: lines[1], index: lines[2]}
	if !filepath.IsAbs(r.index) {
		r.index = filepath.Join(dir, r.index)
	}
	return r, nil
}

// repoError gives openRepo's errors their kind (a cancelled context stays
// as it is).
func repoError(err error) error {
	if errors.Is(err, ErrNotGitRepository) {
		return errdefs.Invalid(err)
	}
	return err
}

// stateDir is where the sync keeps its files in the local repository:
// <git dir>/sandboxd, invisible to git and never synced.
func (r repo) stateDir() string { return filepath.Join(r.gitDir, "sandboxd") }

// tempIndex makes a copy of the repository's index (so `git add` only
// rehashes files whose stat data changed) and returns its path and a cleanup.
func (r repo) tempIndex() (string, func(), error) {
	dir := r.stateDir()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", nil, fmt.Errorf("create %s: %w", dir, err)
	}
	f, err := os.CreateTemp(dir, "index-*")
	if err != nil {
		return "", nil, fmt.Errorf("create a temporary index: %w", err)
	}
	name := f.Name()
	cleanup := func() { _ = os.Remove(name); _ = os.Remove(name + ".lock") }
	src, err := os.Open(r.index)
	switch {
	case errors.Is(err, os.ErrNotExist):
		// No index yet: git builds one from scratch. An empty file would
		// be read as a corrupt index, so leave none.
		_ = f.Close()
		_ = os.Remove(name)
		return name, cleanup, nil
	case err != nil:
		_ = f.Close()
		cleanup()
		return "", nil, fmt.Errorf("read the index: %w", err)
	}
	defer src.Close()
	if _, err := io.Copy(f, src); err != nil {
		_ = f.Close()
		cleanup()
		return "", nil, fmt.Errorf("copy the index: %w", err)
	}
	if err := f.Close(); err != nil {
		cleanup()
		return "", nil, fmt.Errorf("copy the index: %w", err)
	}
	// The copy keeps the index's time: git trusts an entry's stat data only
	// when the file is older than the index ("racy git"), so a copy dated
	// now would let a file rewritten with the same size within the same
	// second as the last index write pass for unchanged.
	if fi, err := src.Stat(); err == nil {
		if err := os.Chtimes(name, fi.ModTime(), fi.ModTime()); err != nil {
			cleanup()
			return "", nil, fmt.Errorf("copy the index: %w", err)
		}
	}
	return name, cleanup, nil
}

// limitedBuffer keeps at most max bytes and reports overflow instead of
// growing: a runaway patch must not exhaust the daemon's memory.
type limitedBuffer struct {
	max      int64
	buf      *bytes.Buffer
	overflow bool
	// failOnOverflow makes Write return errOverflow, so the producer stops.
	failOnOverflow bool
}

var errOverflow = errors.New("output over the size limit")

func (b *limitedBuffer) Write(p []byte) (int, error) {
	room := b.max - int64(b.buf.Len())
	if int64(len(p)) > room {
		b.overflow = true
		if room > 0 {
			b.buf.Write(p[:room])
		}
		if b.failOnOverflow {
			return 0, errOverflow
		}
		return len(p), nil
	}
	return b.buf.Write(p)
}

// splitZ splits NUL-terminated output.
func splitZ(b []byte) []string {
	s := strings.TrimSuffix(string(b), "\x00")
	if s == "" {
		return nil
	}
	return strings.Split(s, "\x00")
}

// diffOptions make a patch that `git apply` takes whatever the user's or the
// sandbox's configuration says about prefixes, colors and external tools.
var diffOptions = []string{
	"--binary", "--full-index", "-M", "--no-color", "--no-ext-diff", "--no-textconv",
	"--src-prefix=a/", "--dst-prefix=b/", "--ignore-submodules=all",
}

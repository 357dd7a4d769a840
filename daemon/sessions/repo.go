package sessions

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/sandboxd/sandboxd/errdefs"
)

// DefaultConfigRel is the config file used when none is given.
const DefaultConfigRel = ".rwx/sandbox.yml"

// findRepoRoot walks up from dir to the directory holding .git (a directory,
// or a file for worktrees and submodules). It runs no git subprocess: the
// exec hot path resolves sessions with file-system reads only.
func findRepoRoot(dir string) (string, error) {
	for d := dir; ; {
		if _, err := os.Lstat(filepath.Join(d, ".git")); err == nil {
			return d, nil
		} else if !errors.Is(err, fs.ErrNotExist) {
			return "", fmt.Errorf("look for .git in %s: %w", d, err)
		}
		parent := filepath.Dir(d)
		if parent == d {
			return "", errdefs.Invalid(&notRepoError{dir: dir})
		}
		d = parent
	}
}

// notRepoError says a directory is outside any git repository. Its message
// names the fix every command shares; the commands that can also work on a
// run by id (--id) say so themselves (withIDHint).
type notRepoError struct{ dir string }

func (e *notRepoError) Error() string {
	return fmt.Sprintf("%s is not inside a git repository: run nook from your project's checkout", e.dir)
}

// withIDHint adds the --id alternative to a not-a-repository error, for the
// commands that take --id.
func withIDHint(err error) error {
	var nr *notRepoError
	if errors.As(err, &nr) {
		return errdefs.Invalidf("%s, or pass --id RUN to use an existing sandbox", nr.Error())
	}
	return err
}

// findConfig returns the absolute config file: explicit (relative to cwd)
// or the nearest .rwx/sandbox.yml walking up from cwd to the repository root.
// It must lie inside the repository.
func findConfig(cwd, repoRoot, explicit string) (string, error) {
	if explicit != "" {
		p := explicit
		if !filepath.IsAbs(p) {
			p = filepath.Join(cwd, p)
		}
		p = filepath.Clean(p)
		if !within(repoRoot, p) {
			return "", errdefs.Invalidf("config file %s is outside the repository %s: sandbox configs live in the repository (for example %s)", p, repoRoot, DefaultConfigRel)
		}
		return p, nil
	}
	for d := cwd; within(repoRoot, d); d = filepath.Dir(d) {
		p := filepath.Join(d, DefaultConfigRel)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
		if d == repoRoot {
			break
		}
	}
	// Not found: the identity still names the default so that a later
	// `nook init` creates the file this session expects.
	return filepath.Join(repoRoot, DefaultConfigRel), nil
}

func within(root, p string) bool {
	rel, err := filepath.Rel(root, p)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, ".."+string(filepath.Separator))
}

// gitRunner runs git subprocesses for the cold paths (create, adoption);
// the hot path never calls it.
type gitRunner struct{ binary string }

func (g gitRunner) output(ctx context.Context, dir string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, g.binary, args...)
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("git %s in %s: %w: %s", strings.Join(args, " "), dir, err, strings.TrimSpace(stderr.String()))
	}
	return strings.TrimSpace(string(out)), nil
}

// head returns the commit HEAD points at, or an error saying the repository
// has no commits yet.
func (g gitRunner) head(ctx context.Context, repo string) (string, error) {
	cmd := exec.CommandContext(ctx, g.binary, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
	cmd.Dir = repo
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	sha := strings.TrimSpace(string(out))
	if err == nil && sha != "" {
		return sha, nil
	}
	return "", gitFailure(ctx, repo, "read HEAD", err, stderr.String(), func() error {
		return errdefs.Invalidf("the repository %s has no commits yet: commit something first (git commit --allow-empty -m init), then retry", repo)
	})
}

// gitFailure says why a git command in repo failed: the caller's deadline,
// git refusing a repository owned by someone else, git missing, or git's own
// message; quiet is the caller's meaning of a plain failure with nothing on
// stderr (rev-parse --quiet: no such commit).
func gitFailure(ctx context.Context, repo, what string, err error, stderr string, quiet func() error) error {
	stderr = strings.TrimSpace(stderr)
	var ee *exec.ExitError
	switch {
	case ctx.Err() != nil:
		return errdefs.Timeout(fmt.Errorf("git (%s in %s) did not finish in time (%w): is the repository very large or on a slow disk? retry, or check with `git -C %s status`", what, repo, ctx.Err(), repo))
	case strings.Contains(stderr, "dubious ownership"):
		return errdefs.Invalidf("git refuses the repository %s because it belongs to another user (\"dubious ownership\"): if you trust it, run `git config --global --add safe.directory %s`, then retry", repo, repo)
	case errors.Is(err, exec.ErrNotFound):
		return fmt.Errorf("git (%s in %s): git is not installed or not on sandboxd's PATH: %w", what, repo, err)
	case errors.As(err, &ee) && stderr == "" && quiet != nil:
		return quiet()
	case err == nil:
		return quiet()
	}
	return fmt.Errorf("git (%s in %s) failed: %w: %s", what, repo, err, stderr)
}

// origin returns the URL of the origin remote, or "" when there is none.
func (g gitRunner) origin(ctx context.Context, repo string) string {
	u, err := g.output(ctx, repo, "remote", "get-url", "origin")
	if err != nil {
		return ""
	}
	return u
}

// pushedBase returns the newest commit of HEAD that some origin ref has, the
// commit a cloud sandbox can check out; unpushed commits then travel in the
// sync patch.
func (g gitRunner) pushedBase(ctx context.Context, repo string) (string, error) {
	out, err := g.output(ctx, repo, "rev-list", "HEAD", "--not", "--remotes=origin", "--boundary")
	if err != nil {
		return "", err
	}
	if out == "" {
		return g.head(ctx, repo)
	}
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "-") {
			return strings.TrimPrefix(line, "-"), nil
		}
	}
	return "", errdefs.Invalidf("no commit of HEAD is on origin in %s: push your branch (git push -u origin HEAD) so the sandbox can check it out", repo)
}

// isAncestor reports whether commit a is an ancestor of (or equal to) b.
func (g gitRunner) isAncestor(ctx context.Context, repo, a, b string) bool {
	cmd := exec.CommandContext(ctx, g.binary, "merge-base", "--is-ancestor", a, b)
	cmd.Dir = repo
	return cmd.Run() == nil
}

package sessions

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/errdefs"
)

// TestHeadReportsTheRealCause: a failing `git rev-parse` is reported as
// what it is (an empty repository, a deadline, git's "dubious ownership"
// with the command that fixes it), never all of them as "no commits yet".
func TestHeadReportsTheRealCause(t *testing.T) {
	t.Setenv("HOME", t.TempDir())
	t.Setenv("GIT_CONFIG_NOSYSTEM", "1")
	repo := t.TempDir()
	if out, err := exec.Command("git", "init", "-q", repo).CombinedOutput(); err != nil {
		t.Fatalf("git init: %v %s", err, out)
	}
	g := gitRunner{binary: "git"}
	if _, err := g.head(context.Background(), repo); !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "no commits yet") {
		t.Fatalf("empty repository: %v", err)
	}
	done, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := g.head(done, repo); !errors.Is(err, errdefs.ErrTimeout) || strings.Contains(err.Error(), "no commits") {
		t.Fatalf("deadline: %v", err)
	}
	if os.Getuid() != 0 {
		t.Skip("needs root to give the repository to another user")
	}
	if err := os.Chown(repo, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	_, err := g.head(context.Background(), repo)
	if !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "dubious ownership") || !strings.Contains(err.Error(), "git config --global --add safe.directory "+repo) {
		t.Fatalf("a repository of another user: %v", err)
	}
}

package gitsync

import (
	"context"
	"strings"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/internal/gitobj"
)

// localHead returns the commit HEAD points to. The common layouts (a
// detached HEAD, a loose ref, a packed ref) are read without a git process;
// anything else asks git.
func (s *Syncer) localHead(ctx context.Context, r repo) (string, error) {
	if sha, ok := gitobj.ReadRef(r.gitDir, "HEAD"); ok {
		return sha, nil
	}
	out, err := s.run(ctx, gitCall{dir: r.root}, "rev-parse", "-q", "--verify", "HEAD^{commit}")
	if err != nil {
		if ctx.Err() != nil {
			return "", ctx.Err()
		}
		return "", errdefs.Invalid(newError(ErrEmptyRepository, err,
			"the repository %s has no commits yet, so a sandbox has nothing to start from: make a first commit (for example `git commit --allow-empty -m 'initial commit'`) and run the command again", r.root))
	}
	return strings.TrimSpace(string(out)), nil
}

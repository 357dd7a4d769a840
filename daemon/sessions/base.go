package sessions

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/sandboxd/sandboxd/daemon/gitsync"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/store"
)

// learnBase records, for a run sandboxd did not create (started by the RWX
// CLI, or adopted after its record was lost), the commit the sandbox has
// checked out as the base of the sync: one command on the first synced exec.
func (m *Manager) learnBase(ctx context.Context, r gitsync.Runner, s *store.Session) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, learnBaseWait)
	defer cancel()
	out, errb := newAnswer(128), newAnswer(1024) // a sha
	code, err := r.Run(ctx, "git rev-parse --verify HEAD^{commit}", nil, out, errb)
	if err != nil {
		return "", errdefs.Unavailable(fmt.Errorf("ask the sandbox for its commit: %w", err))
	}
	sha := strings.TrimSpace(out.String())
	if code != 0 || !fullSHA.MatchString(sha) {
		return "", errdefs.Conflictf("the sandbox %s has no commit checked out (%s): `nook reset` starts one at your current commit", s.RunID, printable(strings.TrimSpace(errb.String()), 512))
	}
	if _, err := m.git.output(ctx, s.RepoRoot, "cat-file", "-e", sha+"^{commit}"); err != nil {
		return "", errdefs.Conflictf("the sandbox %s is at commit %s, which %s does not have: fetch it (git fetch), or `nook reset` to start a sandbox at your current commit", s.RunID, sha[:12], s.RepoRoot)
	}
	if _, err := m.st.Update(s.ID, func(s *store.Session) error {
		if s.BaseSHA == "" {
			s.BaseSHA = sha
		}
		return nil
	}); err != nil {
		m.log.Warn("record the sandbox's base commit", "session", s.ID, "err", err)
	}
	return sha, nil
}

// learnBaseWait bounds asking the sandbox for its commit.
const learnBaseWait = 30 * time.Second

var fullSHA = regexp.MustCompile(`^[0-9a-f]{40}([0-9a-f]{24})?$`)

package sessions

import (
	"bytes"
	"context"
	"fmt"
	"io"
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
	// The answer is the sandbox's: bounded in size and time, and checked.
	var out, errb bytes.Buffer
	ctx, cancel := context.WithTimeout(ctx, learnBaseTimeout)
	defer cancel()
	code, err := r.Run(ctx, "git rev-parse --verify HEAD^{commit}", nil, &capped{w: &out, n: 256}, &capped{w: &errb, n: 4096})
	if err != nil {
		return "", errdefs.Unavailable(fmt.Errorf("ask the sandbox for its commit: %w", err))
	}
	sha := strings.TrimSpace(out.String())
	if code != 0 || !fullSHA.MatchString(sha) {
		return "", errdefs.Conflictf("the sandbox %s has no commit checked out (%s): `sbx reset` starts one at your current commit", s.RunID, strings.TrimSpace(errb.String()))
	}
	if _, err := m.git.output(ctx, s.RepoRoot, "cat-file", "-e", sha+"^{commit}"); err != nil {
		return "", errdefs.Conflictf("the sandbox %s is at commit %s, which %s does not have: fetch it (git fetch), or `sbx reset` to start a sandbox at your current commit", s.RunID, sha[:12], s.RepoRoot)
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

var fullSHA = regexp.MustCompile(`^[0-9a-f]{40}([0-9a-f]{24})?$`)

// learnBaseTimeout bounds the sandbox's answer to learnBase.
const learnBaseTimeout = 30 * time.Second

// capped keeps the first n bytes written to it: an answer from the
// sandbox is no larger than what it can mean.
type capped struct {
	w io.Writer
	n int
}

func (c *capped) Write(p []byte) (int, error) {
	if k := min(len(p), c.n); k > 0 {
		_, _ = c.w.Write(p[:k])
		c.n -= k
	}
	return len(p), nil
}

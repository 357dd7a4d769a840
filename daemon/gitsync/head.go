package gitsync

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"

	"github.com/sandboxd/sandboxd/errdefs"
)

// localHead returns the commit HEAD points to. The common layouts (a
// detached HEAD, a loose ref, a packed ref) are read without a git process;
// anything else asks git.
func (s *Syncer) localHead(ctx context.Context, r repo) (string, error) {
	if sha, ok := readHead(r.gitDir); ok {
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

// readHead resolves HEAD from the files of a plain (non-worktree) git
// directory; ok is false when git should be asked instead.
func readHead(gitDir string) (string, bool) {
	b, err := os.ReadFile(filepath.Join(gitDir, "HEAD"))
	if err != nil {
		return "", false
	}
	head := strings.TrimSpace(string(b))
	if shaPattern.MatchString(head) {
		return head, true
	}
	ref, ok := strings.CutPrefix(head, "ref: ")
	if !ok || !strings.HasPrefix(ref, "refs/") || strings.Contains(ref, "..") {
		return "", false
	}
	if _, err := os.Stat(filepath.Join(gitDir, "commondir")); err == nil {
		return "", false // a linked worktree: its refs live elsewhere
	}
	if b, err := os.ReadFile(filepath.Join(gitDir, filepath.FromSlash(ref))); err == nil {
		sha := strings.TrimSpace(string(b))
		if shaPattern.MatchString(sha) {
			return sha, true
		}
		return "", false // a symbolic ref to a ref
	}
	f, err := os.Open(filepath.Join(gitDir, "packed-refs"))
	if err != nil {
		return "", false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	suffix := []byte(" " + ref)
	for sc.Scan() {
		line := sc.Bytes()
		if bytes.HasSuffix(line, suffix) {
			sha := string(line[:len(line)-len(suffix)])
			if shaPattern.MatchString(sha) {
				return sha, true
			}
		}
	}
	return "", false
}

package gitsync

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
)

// indexPaths is what the sync needs from the user's index: which paths are
// tracked (git add -A keeps a tracked file even when it is ignored) and
// which are submodules. It is asked of git only when the index file
// changed (its stamp), not on every Prepare.
type indexPaths struct {
	paths    []string // sorted, as git sorts
	gitlinks []string // sorted
}

var errIndexUnusual = errors.New("the index has skip-worktree entries (sparse checkout), which the sync does not follow")

// readIndexPaths lists the paths the user's index tracks (`git ls-files
// -s -t`). An index with skip-worktree entries is errIndexUnusual: git add
// -A leaves those alone, which the sync index of the changed paths would
// not know, so the caller scans everything, as git would.
func (s *Syncer) readIndexPaths(ctx context.Context, r repo) (*indexPaths, error) {
	out, err := s.run(ctx, gitCall{dir: r.root}, "ls-files", "-z", "-s", "-t")
	if err != nil {
		return nil, fmt.Errorf("list the paths your index tracks: %w", err)
	}
	ix := &indexPaths{}
	for _, rec := range splitZ(out) {
		// "<tag> <mode> <object> <stage>\t<path>"
		head, p, ok := strings.Cut(rec, "\t")
		f := strings.Fields(head)
		if !ok || len(f) != 4 {
			return nil, fmt.Errorf("git ls-files printed %q", clip([]byte(rec)))
		}
		if f[0] == "S" {
			return nil, errIndexUnusual
		}
		if f[1] == "160000" {
			ix.gitlinks = append(ix.gitlinks, p)
		}
		// The stages of an unmerged path come one after another.
		if n := len(ix.paths); n == 0 || ix.paths[n-1] != p {
			ix.paths = append(ix.paths, p)
		}
	}
	// git's order is bytewise, as sort.Strings'; sorted again in case a
	// setting changes it.
	sort.Strings(ix.paths)
	sort.Strings(ix.gitlinks)
	return ix, nil
}

func (ix *indexPaths) tracked(p string) bool {
	i := sort.SearchStrings(ix.paths, p)
	return i < len(ix.paths) && ix.paths[i] == p
}

// inSubmodule tells whether p is a submodule or inside one.
func (ix *indexPaths) inSubmodule(p string) bool {
	for _, g := range ix.gitlinks {
		if p == g || strings.HasPrefix(p, g+"/") {
			return true
		}
	}
	return false
}

// changedPaths lists the paths tracked in one of a and b and not the
// other, submodules included.
func changedPaths(a, b *indexPaths) []string {
	out := symmetricDiff(a.paths, b.paths)
	return append(out, symmetricDiff(a.gitlinks, b.gitlinks)...)
}

func symmetricDiff(a, b []string) []string {
	var out []string
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		switch {
		case j >= len(b) || (i < len(a) && a[i] < b[j]):
			out = append(out, a[i])
			i++
		case i >= len(a) || b[j] < a[i]:
			out = append(out, b[j])
			j++
		default:
			i++
			j++
		}
	}
	return out
}

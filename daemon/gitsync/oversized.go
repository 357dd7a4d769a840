package gitsync

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/sandboxd/sandboxd/errdefs"
)

// oversized refuses, from their sizes on disk alone, changes that hold a
// file over the patch limit: paths (relative to the root; nil: every
// untracked file git does not ignore and every tracked one whose stat
// changed) are measured before anything reads
// them, so that such a file is refused at once on every sync instead of
// after it was staged and diffed. Ignored files are left alone.
func (s *Syncer) oversized(ctx context.Context, r repo, paths []string) error {
	if paths == nil {
		out, err := s.run(ctx, gitCall{dir: r.root}, "ls-files", "-o", "-m", "--exclude-standard", "-z")
		if err != nil {
			return nil // the scan that follows reports what is wrong
		}
		paths = splitZ(out)
	}
	type sized struct {
		path string
		size int64
	}
	var big []sized
	for _, p := range paths {
		fi, err := os.Lstat(filepath.Join(r.root, p))
		if err == nil && fi.Mode().IsRegular() && fi.Size() > s.maxBytes {
			big = append(big, sized{p, fi.Size()})
		}
	}
	if len(big) == 0 {
		return nil
	}
	// Rare: only files over the limit are asked about.
	var in bytes.Buffer
	for _, b := range big {
		in.WriteString(b.path)
		in.WriteByte(0)
	}
	ignored := map[string]bool{}
	if out, err := s.run(ctx, gitCall{dir: r.root, stdin: &in, literal: true}, "check-ignore", "-z", "--stdin"); err == nil {
		for _, p := range splitZ(out) {
			ignored[p] = true
		}
	}
	kept := big[:0]
	for _, b := range big {
		if !ignored[b.path] {
			kept = append(kept, b)
		}
	}
	if len(kept) == 0 {
		return nil
	}
	sort.Slice(kept, func(i, j int) bool { return kept[i].size > kept[j].size })
	var names []string
	for i := 0; i < len(kept) && i < 3; i++ {
		names = append(names, kept[i].path+" ("+formatBytes(kept[i].size)+")")
	}
	return errdefs.TooLarge(newError(ErrPatchTooLarge, nil,
		"your changes hold files over the %s limit of a sync patch (%s): commit and push large files, or add them to .gitignore, or use --no-sync",
		formatBytes(s.maxBytes), strings.Join(names, ", ")))
}

// nonNil is paths, never nil (nil asks oversized to list them).
func nonNil(paths []string) []string {
	if paths == nil {
		return []string{}
	}
	return paths
}

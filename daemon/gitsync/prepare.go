package gitsync

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
)

var shaPattern = regexp.MustCompile(`^([0-9a-f]{40}|[0-9a-f]{64})$`)

// Prepare builds, locally, what makes the sandbox's checkout equal to
// repoRoot's working tree: the local HEAD commit (pushed by Push with git's
// own protocol when the sandbox lacks it) and the patch from HEAD to the
// working tree: staged, unstaged and untracked (non-ignored) files,
// deletions, renames, mode changes, binary files. baseSHA is the commit the
// sandbox was started at. The user's index and files are left untouched:
// the changes are staged into a copy of the index (GIT_INDEX_FILE). Changed
// Git LFS files are left out and named in a warning.
func (s *Syncer) Prepare(ctx context.Context, repoRoot, baseSHA string) (*Patch, error) {
	start := time.Now()
	r, err := s.openRepo(ctx, repoRoot)
	if err != nil {
		return nil, repoError(err)
	}
	head, err := s.localHead(ctx, r)
	if err != nil {
		return nil, err
	}
	if baseSHA == "" {
		return nil, errdefs.Invalid(errors.New("the session has no base commit to sync against: run `sbx reset` to start a sandbox at your current commit"))
	}
	if !shaPattern.MatchString(baseSHA) {
		return nil, errdefs.Invalid(fmt.Errorf("the base commit %q is not a full commit id: run `sbx reset` to start a new sandbox", baseSHA))
	}

	index, cleanup, err := r.tempIndex()
	if err != nil {
		return nil, fmt.Errorf("prepare the sync patch: %w", err)
	}
	defer cleanup()
	staged := gitCall{dir: r.root, index: index}
	if _, err := s.run(ctx, staged, "add", "-A"); err != nil {
		return nil, fmt.Errorf("stage the working tree into a temporary index: %w", err)
	}
	// One diff gives both the file list (raw, NUL-separated) and the patch.
	args := append([]string{"diff", "--cached", "--raw", "-z", "-p"}, diffOptions...)
	args = append(args, head, "--")
	out := &limitedBuffer{max: s.maxBytes + rawAllowance, buf: &bytes.Buffer{}, failOnOverflow: true}
	if _, err := s.run(ctx, gitCall{dir: r.root, index: index, stdout: out}, args...); err != nil && !out.overflow {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("compute the changes since %s: %w", short(head), err)
	}
	if out.overflow {
		return nil, s.tooLarge(ctx, r, index, head)
	}
	files, added, data := parseRawPatch(out.buf.Bytes())
	p := &Patch{RepoRoot: r.root, BaseSHA: baseSHA, HeadSHA: head, Data: data, Files: files}
	if len(files) > 0 && mayUseLFS(r, files) {
		lfs, err := s.lfsFiles(ctx, r.root, files)
		if err != nil {
			return nil, err
		}
		if len(lfs) > 0 {
			// Rare: diff again without them.
			args = append(args, ".")
			for _, f := range lfs {
				args = append(args, ":(exclude,literal)"+f)
			}
			out = &limitedBuffer{max: s.maxBytes + rawAllowance, buf: &bytes.Buffer{}, failOnOverflow: true}
			if _, err := s.run(ctx, gitCall{dir: r.root, index: index, stdout: out}, args...); err != nil && !out.overflow {
				return nil, fmt.Errorf("compute the sync patch: %w", err)
			}
			if out.overflow {
				return nil, s.tooLarge(ctx, r, index, head)
			}
			_, _, p.Data = parseRawPatch(out.buf.Bytes())
			p.LFSFiles = lfs
			p.Files = without(files, lfs)
		}
	}
	if int64(len(p.Data)) > s.maxBytes {
		return nil, s.tooLarge(ctx, r, index, head)
	}
	if len(p.LFSFiles) > 0 {
		p.Warnings = append(p.Warnings, fmt.Sprintf("%d Git LFS file(s) changed locally and were not synced to the sandbox (it sees their committed version): %s",
			len(p.LFSFiles), strings.Join(p.LFSFiles, ", ")))
	}
	if w := unresolvedWarning(r, added); w != "" {
		p.Warnings = append(p.Warnings, w)
	}
	s.log.Debug("sync patch prepared", "repo", r.root, "files", len(p.Files), "bytes", len(p.Data), "lfs", len(p.LFSFiles), "took", time.Since(start))
	return p, nil
}

// rawAllowance is room for the raw file list ahead of the patch.
const rawAllowance = 1 << 20

// parseRawPatch splits `git diff --raw -z -p` output into the paths the
// patch changes (new side of renames), the subset that is new, and the
// patch. Raw records are ":<modes> <ids> <status>\0<path>\0[<path>\0]";
// a NUL separates them from the patch.
func parseRawPatch(b []byte) (files, added []string, patch []byte) {
	files = []string{}
	for len(b) > 0 && b[0] == ':' {
		header, rest, ok := bytes.Cut(b, []byte{0})
		if !ok {
			break
		}
		status := byte(0)
		if i := bytes.LastIndexByte(header, ' '); i >= 0 && i+1 < len(header) {
			status = header[i+1]
		}
		paths := 1
		if status == 'R' || status == 'C' {
			paths = 2
		}
		var path string
		for j := 0; j < paths; j++ {
			var p []byte
			p, rest, _ = bytes.Cut(rest, []byte{0})
			path = string(p)
		}
		files = append(files, path)
		if status == 'A' || status == 'R' || status == 'C' {
			added = append(added, path)
		}
		b = rest
	}
	if len(b) > 0 && b[0] == 0 {
		b = b[1:]
	}
	sort.Strings(files)
	return files, added, b
}

// tooLarge explains a patch over the limit, naming the largest files.
func (s *Syncer) tooLarge(ctx context.Context, r repo, index, baseSHA string) error {
	var files []string
	if out, err := s.run(ctx, gitCall{dir: r.root, index: index}, "diff", "--cached", "--name-only", "-z", "--no-renames", baseSHA, "--"); err == nil {
		files = splitZ(out)
	}
	return errdefs.TooLarge(newError(ErrPatchTooLarge, nil,
		"your changes make a sync patch over the %s limit (largest changed files: %s): commit and push large files, or add them to .gitignore, or use --no-sync",
		formatBytes(s.maxBytes), largestFiles(r.root, files, 3)))
}

// mayUseLFS tells whether any attributes file that can apply to files
// mentions lfs: the repository's info/attributes, the user's global one,
// and the .gitattributes of every directory on the way to a changed file.
// Only then is `git check-attr` run. (A custom core.attributesFile is not
// read; `git lfs track` writes to .gitattributes.)
func mayUseLFS(r repo, files []string) bool {
	candidates := []string{filepath.Join(r.gitDir, "info", "attributes")}
	if x := os.Getenv("XDG_CONFIG_HOME"); x != "" {
		candidates = append(candidates, filepath.Join(x, "git", "attributes"))
	} else if h := os.Getenv("HOME"); h != "" {
		candidates = append(candidates, filepath.Join(h, ".config", "git", "attributes"))
	}
	dirs := map[string]bool{}
	for _, f := range files {
		for d := filepath.Dir(f); ; d = filepath.Dir(d) {
			if dirs[d] {
				break
			}
			dirs[d] = true
			candidates = append(candidates, filepath.Join(r.root, d, ".gitattributes"))
			if d == "." || d == "/" {
				break
			}
		}
	}
	for _, c := range candidates {
		if b, err := os.ReadFile(c); err == nil && bytes.Contains(b, []byte("lfs")) {
			return true
		}
	}
	return false
}

// lfsFiles returns the files among paths whose filter attribute is lfs. It
// reads .gitattributes only, so git-lfs need not be installed.
func (s *Syncer) lfsFiles(ctx context.Context, dir string, paths []string) ([]string, error) {
	in := strings.Join(paths, "\x00") + "\x00"
	out, err := s.run(ctx, gitCall{dir: dir, stdin: strings.NewReader(in)}, "check-attr", "-z", "--stdin", "filter")
	if err != nil {
		return nil, fmt.Errorf("read git attributes: %w", err)
	}
	var lfs []string
	f := splitZ(out)
	for i := 0; i+2 < len(f); i += 3 {
		if f[i+2] == "lfs" {
			lfs = append(lfs, f[i])
		}
	}
	sort.Strings(lfs)
	return lfs, nil
}

func without(all, drop []string) []string {
	if len(drop) == 0 {
		return all
	}
	skip := make(map[string]bool, len(drop))
	for _, d := range drop {
		skip[d] = true
	}
	out := make([]string, 0, len(all))
	for _, a := range all {
		if !skip[a] {
			out = append(out, a)
		}
	}
	return out
}

// largestFiles names the n largest of paths as they are on disk.
func largestFiles(root string, paths []string, n int) string {
	type sized struct {
		path string
		size int64
	}
	var all []sized
	for _, p := range paths {
		if fi, err := os.Lstat(filepath.Join(root, p)); err == nil {
			all = append(all, sized{p, fi.Size()})
		}
	}
	sort.Slice(all, func(i, j int) bool { return all[i].size > all[j].size })
	var parts []string
	for i := 0; i < len(all) && i < n; i++ {
		parts = append(parts, fmt.Sprintf("%s (%s)", all[i].path, formatBytes(all[i].size)))
	}
	if len(parts) == 0 {
		return "unknown"
	}
	return strings.Join(parts, ", ")
}

func formatBytes(n int64) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	default:
		return fmt.Sprintf("%d bytes", n)
	}
}

func short(sha string) string {
	if len(sha) > 12 {
		return sha[:12]
	}
	return sha
}

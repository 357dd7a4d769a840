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
	return s.prepare(ctx, repoRoot, baseSHA, false)
}

// prepare is Prepare, early when the caller's exchange can take an early
// request (PrepareExchange).
func (s *Syncer) prepare(ctx context.Context, repoRoot, baseSHA string, early bool) (*Patch, error) {
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
		return nil, errdefs.Invalid(errors.New("the session has no base commit to sync against: run `nook reset` to start a sandbox at your current commit"))
	}
	if !shaPattern.MatchString(baseSHA) {
		return nil, errdefs.Invalid(fmt.Errorf("the base commit %q is not a full commit id: run `nook reset` to start a new sandbox", baseSHA))
	}

	if s.changes == nil {
		res, err := s.prepareFull(ctx, r, head)
		if err != nil {
			return nil, err
		}
		return s.finishPatch(r, baseSHA, res, start, "full"), nil
	}
	st := s.prepState(r.root)
	res, how, ea, err := s.prepareTracked(ctx, r, head, st, early)
	if ea != nil {
		// st stays locked until the patch is computed.
		p := s.newEarlyPatch(r, baseSHA, head, ea, start)
		// Not the exec's context: the exec may end first (a quick
		// command), and the next sync needs this one's state.
		go func() {
			ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), earlyPatchTimeout)
			defer cancel()
			s.finishEarly(ctx, r, head, st, p)
		}()
		return p, nil
	}
	st.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return s.finishPatch(r, baseSHA, res, start, how), nil
}

// prepared is the working tree's difference from HEAD.
type prepared struct {
	head  string
	data  []byte
	files []string // the paths the patch changes (new side of renames)
	added []string
	lfs   []string
	// recs are the diff's records, LFS files included.
	recs []rawRec
}

// finishPatch makes the Patch the caller owns (the cached result stays
// untouched) with its warnings.
func (s *Syncer) finishPatch(r repo, baseSHA string, res *prepared, start time.Time, how string) *Patch {
	p := &Patch{RepoRoot: r.root, BaseSHA: baseSHA, HeadSHA: res.head, Data: res.data,
		Files: append([]string{}, res.files...), LFSFiles: append([]string(nil), res.lfs...),
		recs: res.recs}
	if fi, err := os.Stat(r.index); err == nil && fi.Size() >= s.largeIndex {
		p.LargeTree = true
	}
	if len(p.LFSFiles) > 0 {
		p.Warnings = append(p.Warnings, fmt.Sprintf("%d Git LFS file(s) changed locally and were not synced to the sandbox (it sees their committed version): %s",
			len(p.LFSFiles), strings.Join(p.LFSFiles, ", ")))
	}
	if w := unresolvedWarning(r, res.added); w != "" {
		p.Warnings = append(p.Warnings, w)
	}
	if s.observe != nil {
		s.observe(how)
	}
	s.log.Debug("sync patch prepared", "repo", r.root, "how", how, "files", len(p.Files), "bytes", len(p.Data), "lfs", len(p.LFSFiles), "took", time.Since(start))
	return p
}

// prepareFull stages the whole working tree into a copy of the user's
// index and diffs it against head.
func (s *Syncer) prepareFull(ctx context.Context, r repo, head string) (*prepared, error) {
	index, cleanup, err := r.tempIndex()
	if err != nil {
		return nil, fmt.Errorf("prepare the sync patch: %w", err)
	}
	defer cleanup()
	if err := s.oversized(ctx, r, nil); err != nil {
		return nil, err
	}
	staged := gitCall{dir: r.root, index: index}
	if _, err := s.run(ctx, staged, "add", "-A"); err != nil {
		return nil, fmt.Errorf("stage the working tree into a temporary index: %w", err)
	}
	res, err := s.diffIndex(ctx, r, index, head, nil)
	if errors.Is(err, errOverflow) {
		return nil, s.tooLarge(ctx, r, index, head)
	}
	return res, err
}

// diffIndex diffs index against head, limited to pathspec (literal paths)
// when it is not nil. LFS files are left out of the patch. errOverflow
// says the patch is over the limit.
func (s *Syncer) diffIndex(ctx context.Context, r repo, index, head string, pathspec []string) (*prepared, error) {
	// One diff gives both the file list (raw, NUL-separated) and the patch.
	args := append([]string{"diff", "--cached", "--raw", "-z", "-p", "--no-abbrev"}, diffOptions...)
	args = append(args, head, "--")
	call := gitCall{dir: r.root, index: index}
	if pathspec != nil {
		call.literal = true
		args = append(args, pathspec...)
	}
	out := &limitedBuffer{max: s.maxBytes + rawAllowance, buf: &bytes.Buffer{}, failOnOverflow: true}
	call.stdout = out
	if _, err := s.run(ctx, call, args...); err != nil && !out.overflow {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("compute the changes since %s: %w", short(head), err)
	}
	if out.overflow {
		return nil, errOverflow
	}
	recs, data := parseRaw(out.buf.Bytes())
	files, added := recFiles(recs)
	res := &prepared{head: head, data: data, files: files, added: added, recs: recs}
	if len(files) > 0 && mayUseLFS(r, files) {
		lfs, err := s.lfsFiles(ctx, r.root, files)
		if err != nil {
			return nil, err
		}
		if len(lfs) > 0 {
			// Rare: diff again without them.
			if pathspec != nil {
				args = append(args[:len(args)-len(pathspec)], without(pathspec, lfs)...)
			} else {
				args = append(args, ".")
				for _, f := range lfs {
					args = append(args, ":(exclude,literal)"+f)
				}
			}
			out = &limitedBuffer{max: s.maxBytes + rawAllowance, buf: &bytes.Buffer{}, failOnOverflow: true}
			call.stdout = out
			if _, err := s.run(ctx, call, args...); err != nil && !out.overflow {
				return nil, fmt.Errorf("compute the sync patch: %w", err)
			}
			if out.overflow {
				return nil, errOverflow
			}
			_, res.data = parseRaw(out.buf.Bytes())
			res.lfs = lfs
			res.files = without(files, lfs)
		}
	}
	if int64(len(res.data)) > s.maxBytes {
		return nil, errOverflow
	}
	return res, nil
}

// rawAllowance is room for the raw file list ahead of the patch.
const rawAllowance = 1 << 20

// rawRec is one record of `git diff --raw -z --no-abbrev`.
type rawRec struct {
	srcMode string
	srcSHA  string
	dstMode string
	dstSHA  string
	status  byte
	src     string // the old path of a rename or copy, else the path
	dst     string
}

// parseRaw splits `git diff --raw -z -p` output into its records and the
// patch. Records are ":<modes> <ids> <status>\0<path>\0[<path>\0]"; a NUL
// separates them from the patch.
func parseRaw(b []byte) (recs []rawRec, patch []byte) {
	for len(b) > 0 && b[0] == ':' {
		header, rest, ok := bytes.Cut(b, []byte{0})
		if !ok {
			break
		}
		var rec rawRec
		if f := strings.Fields(string(header[1:])); len(f) == 5 {
			rec.srcMode, rec.dstMode, rec.srcSHA, rec.dstSHA = f[0], f[1], f[2], f[3]
			if f[4] != "" {
				rec.status = f[4][0]
			}
		}
		paths := 1
		if rec.status == 'R' || rec.status == 'C' {
			paths = 2
		}
		for j := 0; j < paths; j++ {
			var p []byte
			p, rest, _ = bytes.Cut(rest, []byte{0})
			if j == 0 {
				rec.src = string(p)
			}
			rec.dst = string(p)
		}
		recs = append(recs, rec)
		b = rest
	}
	if len(b) > 0 && b[0] == 0 {
		b = b[1:]
	}
	return recs, b
}

// recFiles gives the paths a patch changes (new side of renames), sorted,
// and the subset that is new.
func recFiles(recs []rawRec) (files, added []string) {
	files = []string{}
	for _, r := range recs {
		files = append(files, r.dst)
		if r.status == 'A' || r.status == 'R' || r.status == 'C' {
			added = append(added, r.dst)
		}
	}
	sort.Strings(files)
	return files, added
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
	if len(paths) == 0 {
		return nil, nil
	}
	// No attributes file that could apply mentions lfs (the common case):
	// no process. Only the plain layout is read; others ask git.
	if fi, err := os.Stat(filepath.Join(dir, ".git")); err == nil && fi.IsDir() {
		if !mayUseLFS(repo{root: dir, gitDir: filepath.Join(dir, ".git")}, paths) {
			return nil, nil
		}
	}
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

package gitsync

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
)

// ChangeTracker tells which paths of a working tree changed since its
// previous answer for that tree (internal/watch.Trees). full says it does not
// know: the whole tree must be looked at.
type ChangeTracker interface {
	// Changes returns the changed paths (slash-separated, relative to
	// root): files, symlinks and directories that appeared, changed or went
	// away (a directory that appeared comes with everything under it), and
	// gone, the directories whose whole subtree went away. cookieDir is a
	// directory outside the tree the tracker may write marker files to.
	Changes(ctx context.Context, root, cookieDir string) (paths, gone []string, full bool)
}

// maxIncremental bounds the paths looked at one by one; more than that and
// a full scan is as cheap.
const maxIncremental = 2000

// maxPathspecBytes bounds the command line of the incremental diff.
const maxPathspecBytes = 512 << 10

// prepState is what the previous Prepare of a repository left, so the next
// one looks only at what changed since (the paths the tracker names).
//
// Invariant, when valid: the sync index holds, for every path of changed
// that exists in the working tree as git add -A sees it, its content as
// of the last Prepare (inSmall lists the paths the sync index holds); every
// other path the user's git sees is as in head, unless the tracker names
// it.
type prepState struct {
	mu      sync.Mutex
	valid   bool
	head    string
	stamps  []stamp     // files whose change calls for a full scan
	indexSt stamp       // the user's index
	index   *indexPaths // the user's index as of the last Prepare
	small   string      // the sync index: only the changed paths
	inSmall map[string]bool
	changed map[string]bool // every path the diff named (both sides of renames)
	res     *prepared
	// ignoreKnown is what git said of untracked paths since the last full
	// scan: ignored or not.
	ignoreKnown map[string]bool
	// plain: the configuration converts no file (configFiles); earlyOff:
	// an early request's entries disagreed with git's staging, so the
	// repository's requests wait for the patch until its configuration or
	// rules change.
	plain, earlyOff bool
}

// stamp identifies a file's version without reading it.
type stamp struct {
	path    string
	exists  bool
	size    int64
	mtime   int64
	ctime   int64
	ino     uint64
	modeBit uint32
}

func stampOf(p string) stamp {
	st := stamp{path: p}
	fi, err := os.Stat(p)
	if err != nil {
		return st
	}
	st.exists, st.size, st.mtime, st.modeBit = true, fi.Size(), fi.ModTime().UnixNano(), uint32(fi.Mode())
	st.ino, st.ctime = inodeAndCtime(fi)
	return st
}

func (s *Syncer) prepState(root string) *prepState {
	s.mu.Lock()
	st := s.prep[root]
	if st == nil {
		st = &prepState{}
		s.prep[root] = st
	}
	s.mu.Unlock()
	st.mu.Lock()
	return st
}

// configFiles are the files outside the working tree that change what git
// add -A stages or how: configuration (filters, autocrlf, excludes file),
// excludes, attributes, sparse checkout. plain says git stores files as
// they are, as far as the configuration goes (core.autocrlf unset or
// false, no core.attributesFile): the early request may hash them itself.
func (s *Syncer) configFiles(ctx context.Context, r repo) (files []string, ok, plain bool) {
	ok, plain = true, true
	dirs := []string{r.gitDir}
	if b, err := os.ReadFile(filepath.Join(r.gitDir, "commondir")); err == nil {
		c := strings.TrimSpace(string(b))
		if !filepath.IsAbs(c) {
			c = filepath.Join(r.gitDir, c)
		}
		dirs = append(dirs, c)
	}
	for _, d := range dirs {
		files = append(files, filepath.Join(d, "config"), filepath.Join(d, "config.worktree"),
			filepath.Join(d, "info", "exclude"), filepath.Join(d, "info", "attributes"), filepath.Join(d, "info", "sparse-checkout"))
	}
	home := os.Getenv("HOME")
	xdg := os.Getenv("XDG_CONFIG_HOME")
	if xdg == "" && home != "" {
		xdg = filepath.Join(home, ".config")
	}
	if xdg != "" {
		files = append(files, filepath.Join(xdg, "git", "config"), filepath.Join(xdg, "git", "ignore"), filepath.Join(xdg, "git", "attributes"))
	}
	if home != "" {
		files = append(files, filepath.Join(home, ".gitconfig"))
	}
	for _, v := range []string{"GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM"} {
		if p := os.Getenv(v); p != "" {
			files = append(files, p)
		}
	}
	if os.Getenv("GIT_CONFIG_NOSYSTEM") == "" {
		files = append(files, "/etc/gitconfig")
	}
	// A custom excludes or attributes file, and settings under which git
	// add keeps the index's mode or matches paths its own way (the sync
	// index of the changed paths would not know): asked once per full scan.
	out, err := s.run(ctx, gitCall{dir: r.root}, "config", "-z", "--get-regexp", `^core\.(excludesfile|attributesfile|filemode|symlinks|ignorecase|autocrlf)$`)
	var ge *gitError
	if err != nil && !(errors.As(err, &ge) && ge.code == 1) { // 1: none set
		return nil, false, false
	}
	for _, kv := range splitZ(out) {
		k, v, _ := strings.Cut(kv, "\n")
		switch strings.ToLower(k) {
		case "core.filemode", "core.symlinks":
			if !gitTrue(v) {
				ok = false
			}
			continue
		case "core.ignorecase":
			if gitTrue(v) {
				ok = false
			}
			continue
		case "core.autocrlf":
			if gitTrue(v) || strings.EqualFold(strings.TrimSpace(v), "input") {
				plain = false
			}
			continue
		case "core.attributesfile":
			plain = false
		}
		if v == "" {
			continue
		}
		if rest, ok := strings.CutPrefix(v, "~/"); ok && home != "" {
			v = filepath.Join(home, rest)
		}
		if !filepath.IsAbs(v) {
			v = filepath.Join(r.root, v)
		}
		files = append(files, v)
	}
	return files, ok, plain
}

// gitTrue reads a git boolean ("true" when set without a value).
func gitTrue(v string) bool {
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "", "true", "yes", "on", "1":
		return true
	}
	return false
}

func stampsChanged(old []stamp) bool {
	for _, o := range old {
		if stampOf(o.path) != o {
			return true
		}
	}
	return false
}

// prepareTracked is Prepare with a change tracker: a full scan the first
// time and whenever anything is uncertain, else only the changed paths are
// looked at; nothing changed costs no process at all.
//
// early: the caller's exchange can take an early request (early.go); ea
// is then not nil when the incremental way can make one, and st stays
// locked for finishEarly.
func (s *Syncer) prepareTracked(ctx context.Context, r repo, head string, st *prepState, early bool) (res *prepared, how string, ea *earlyPatch, err error) {
	cookieDir := filepath.Join(r.stateDir(), "watch")
	paths, gone, full := s.changes.Changes(ctx, r.root, cookieDir)
	if ctx.Err() != nil {
		st.valid = false
		return nil, "", nil, ctx.Err()
	}
	why := ""
	switch {
	case full:
		why = "tracker"
	case !st.valid:
		why = "first"
	case stampsChanged(st.stamps):
		why = "config"
	}
	if why == "" {
		if err := s.oversized(ctx, r, nonNil(paths)); err != nil {
			// The tracker named the file once: the next sync scans (and
			// measures) the whole tree, so that it is not left out.
			st.valid = false
			return nil, "", nil, err
		}
		pl, res, err := s.planIncremental(ctx, r, st, head, paths, gone)
		if err == nil && res == nil {
			if early {
				if ea, ok := s.earlyEntries(r, st, head, pl); ok {
					return nil, "early", ea, nil
				}
			}
			res, err = s.stageIncremental(ctx, r, st, head, pl)
		}
		if err == nil {
			if s.verify {
				err = s.verifyFull(ctx, r, head, res)
			}
			return res, "incremental", nil, err
		}
		if ctx.Err() != nil {
			st.valid = false
			return nil, "", nil, ctx.Err()
		}
		var fb *fallback
		if !errors.As(err, &fb) {
			s.log.Debug("incremental sync patch failed; scanning the whole tree", "repo", r.root, "err", err)
			why = "error"
		} else {
			why = fb.why
		}
	}
	st.valid = false
	// The versions the scan starts from: a change after this is seen next
	// time (by a stamp, or by the tracker, whose answer came before).
	indexSt := stampOf(r.index)
	stamps, supported, plain := s.configFiles(ctx, r)
	ix, ixErr := readIndexPaths(r.index, len(head)/2)
	if ixErr == nil && !supported {
		ixErr = errors.New("core.fileMode or core.symlinks is false, or core.ignoreCase true")
	}
	res, err = s.prepareFull(ctx, r, head)
	if err != nil {
		return nil, "", nil, err
	}
	if ixErr != nil {
		// An index the sync cannot read, or settings it does not follow:
		// always the full scan.
		s.log.Debug("every sync of this repository scans the whole tree", "repo", r.root, "why", ixErr)
		return res, "full:" + why, nil, nil
	}
	if err := s.resetSmall(ctx, r, st, res); err != nil {
		s.log.Debug("sync index of changed paths not written; the next sync scans again", "repo", r.root, "err", err)
		return res, "full:" + why, nil, nil
	}
	st.head, st.index, st.indexSt, st.res, st.plain = head, ix, indexSt, res, plain
	if why == "config" || why == "rules" {
		// The configuration or the rules changed: the early request may
		// be tried again.
		st.earlyOff = false
	}
	st.stamps = st.stamps[:0]
	for _, f := range stamps {
		st.stamps = append(st.stamps, stampOf(f))
	}
	st.valid = true
	return res, "full:" + why, nil, nil
}

// fallback says the incremental way does not apply: scan everything.
type fallback struct{ why string }

func (f *fallback) Error() string { return "full scan needed: " + f.why }

// resetSmall rebuilds the sync index from a full scan's records: the
// changed paths that exist, with the content the scan staged.
func (s *Syncer) resetSmall(ctx context.Context, r repo, st *prepState, res *prepared) error {
	if st.small == "" {
		st.small = filepath.Join(r.stateDir(), fmt.Sprintf("sync-index-%d-%s", os.Getpid(), newID()[:8]))
		removeStaleSmall(r)
	}
	_ = os.Remove(st.small)
	st.inSmall = map[string]bool{}
	st.ignoreKnown = map[string]bool{}
	st.changed = map[string]bool{}
	var in bytes.Buffer
	for _, rec := range res.recs {
		st.changed[rec.src] = true
		st.changed[rec.dst] = true
		if rec.status != 'D' && rec.dstMode != "000000" && rec.dstMode != "" {
			fmt.Fprintf(&in, "%s %s\t%s\x00", rec.dstMode, rec.dstSHA, rec.dst)
			st.inSmall[rec.dst] = true
		}
	}
	if in.Len() == 0 {
		return nil
	}
	if _, err := s.run(ctx, gitCall{dir: r.root, index: st.small, stdin: &in}, "update-index", "-z", "--index-info"); err != nil {
		return fmt.Errorf("write the sync index: %w", err)
	}
	return nil
}

// removeStaleSmall removes the sync indexes of daemons no longer running.
func removeStaleSmall(r repo) {
	names, _ := filepath.Glob(filepath.Join(r.stateDir(), "sync-index-*"))
	for _, n := range names {
		var pid int
		var id string
		if _, err := fmt.Sscanf(filepath.Base(n), "sync-index-%d-%s", &pid, &id); err != nil || pid <= 0 {
			continue
		}
		if pid != os.Getpid() && syscall.Kill(pid, 0) == syscall.ESRCH {
			_ = os.Remove(n)
		}
	}
}

// incPlan is what an incremental Prepare stages: the paths fed to the
// sync index (feed; exists says which are in the working tree), removed
// from it whatever git would say (forceRemove), and diffed (pathspec).
type incPlan struct {
	feed, forceRemove []string
	exists            map[string]bool
	pathspec          map[string]bool
	// ignored are untracked paths git ignores (not staged); untracked the
	// fed ones git does not know yet.
	ignored, untracked []string
	// dirs says a directory or a subtree that went away is among the
	// paths: what HEAD holds under it is not named one by one.
	dirs bool
}

// planIncremental, the first half of an incremental Prepare, looks at the
// changed paths (lstat, the user's index, the ignore rules for new
// untracked files) without staging anything; stageIncremental, the second,
// updates the sync index for them and diffs only the paths that can differ
// from HEAD. res is not nil when nothing changed since the last Prepare:
// its result.
func (s *Syncer) planIncremental(ctx context.Context, r repo, st *prepState, head string, paths, gone []string) (pl *incPlan, res *prepared, err error) {
	dirty := map[string]bool{}
	for _, p := range paths {
		dirty[p] = true
	}
	if head != st.head {
		// HEAD moved (a commit, a reset, a checkout): the paths whose
		// content differs between the two commits are looked at too; the
		// checkout's own writes come from the tracker.
		out, err := s.run(ctx, gitCall{dir: r.root}, "diff-tree", "-r", "-z", "--name-only", "--no-renames", st.head, head)
		if err != nil {
			return nil, nil, &fallback{"head"}
		}
		moved := splitZ(out)
		if len(moved) > maxIncremental {
			return nil, nil, &fallback{"head"}
		}
		for _, p := range moved {
			dirty[p] = true
		}
	}
	// The user's index: only which paths it tracks matters.
	if now := stampOf(r.index); now != st.indexSt {
		ix, err := readIndexPaths(r.index, len(st.head)/2)
		if err != nil {
			return nil, nil, &fallback{"index"}
		}
		for _, p := range changedPaths(st.index, ix) {
			dirty[p] = true
		}
		st.index, st.indexSt = ix, now
	}
	if len(dirty) == 0 && len(gone) == 0 && head == st.head {
		return nil, st.res, nil
	}
	if len(dirty)+len(gone) > maxIncremental {
		return nil, nil, &fallback{"many"}
	}
	for _, p := range append(sortedKeys(dirty), gone...) {
		switch path.Base(p) {
		case ".gitignore", ".gitattributes", ".git":
			return nil, nil, &fallback{"rules"}
		}
		if st.index.inSubmodule(p) {
			return nil, nil, &fallback{"submodule"}
		}
	}

	pathspec := map[string]bool{}
	for p := range st.changed {
		pathspec[p] = true
	}
	under := func(dir string) []string {
		var out []string
		for q := range st.inSmall {
			if strings.HasPrefix(q, dir+"/") {
				out = append(out, q)
			}
		}
		return out
	}
	// A subtree that went away: every path under it may differ from HEAD,
	// and the sync index's entries under it are looked at again.
	pl = &incPlan{dirs: len(gone) > 0}
	for _, g := range gone {
		pathspec[g] = true
		dirty[g] = true
		for _, q := range under(g) {
			dirty[q] = true
		}
	}
	var feed, forceRemove, candidates []string
	exists := map[string]bool{}
	queue := sortedKeys(dirty)
	seen := map[string]bool{}
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		if seen[p] {
			continue
		}
		seen[p] = true
		fi, err := os.Lstat(filepath.Join(r.root, filepath.FromSlash(p)))
		switch {
		case errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR):
			feed = append(feed, p)
			pathspec[p] = true
			queue = append(queue, under(p)...)
		case err != nil:
			return nil, nil, fmt.Errorf("look at %s: %w", p, err)
		case fi.IsDir():
			// What is under it is named one by one; the path itself may
			// have been a file.
			pl.dirs = true
			pathspec[p] = true
			if st.inSmall[p] {
				forceRemove = append(forceRemove, p)
			}
			queue = append(queue, under(p)...)
		case fi.Mode().IsRegular() || fi.Mode()&fs.ModeSymlink != 0:
			exists[p] = true
			if st.index.tracked(p) {
				feed = append(feed, p)
				pathspec[p] = true
			} else {
				candidates = append(candidates, p)
			}
		default:
			return nil, nil, &fallback{"special file"}
		}
	}
	if len(candidates) > 0 {
		// Whether git ignores a path changes only with the ignore rules,
		// and any change to those makes a full scan, which forgets: a new
		// file edited again asks git nothing.
		if st.ignoreKnown == nil {
			st.ignoreKnown = map[string]bool{}
		}
		var ask []string
		for _, c := range candidates {
			if _, ok := st.ignoreKnown[c]; !ok {
				ask = append(ask, c)
			}
		}
		if len(ask) > 0 {
			ignored, err := s.ignored(ctx, r, ask)
			if err != nil {
				return nil, nil, err
			}
			for _, c := range ask {
				st.ignoreKnown[c] = ignored[c]
			}
		}
		for _, c := range candidates {
			if st.ignoreKnown[c] {
				// Not staged: absent from the sync index, so a deletion
				// when HEAD has it (untracked since the last Prepare).
				pl.ignored = append(pl.ignored, c)
				pathspec[c] = true
				if st.inSmall[c] {
					forceRemove = append(forceRemove, c)
				}
				continue
			}
			feed = append(feed, c)
			pl.untracked = append(pl.untracked, c)
			pathspec[c] = true
		}
	}
	pl.feed, pl.forceRemove, pl.exists, pl.pathspec = feed, forceRemove, exists, pathspec
	return pl, nil, nil
}

// stageIncremental stages pl into the sync index and diffs it against
// head: today's incremental patch, which leaves st valid on success.
func (s *Syncer) stageIncremental(ctx context.Context, r repo, st *prepState, head string, pl *incPlan) (*prepared, error) {
	feed, forceRemove, exists, pathspec := pl.feed, pl.forceRemove, pl.exists, pl.pathspec

	if len(feed) > 0 {
		in := strings.Join(feed, "\x00") + "\x00"
		if _, err := s.run(ctx, gitCall{dir: r.root, index: st.small, stdin: strings.NewReader(in)},
			"update-index", "-z", "--add", "--remove", "--replace", "--stdin"); err != nil {
			return nil, fmt.Errorf("update the sync index: %w", err)
		}
	}
	if len(forceRemove) > 0 {
		in := strings.Join(forceRemove, "\x00") + "\x00"
		if _, err := s.run(ctx, gitCall{dir: r.root, index: st.small, stdin: strings.NewReader(in)},
			"update-index", "-z", "--force-remove", "--stdin"); err != nil {
			return nil, fmt.Errorf("update the sync index: %w", err)
		}
	}
	// From here the sync index has moved on: a failure must not leave the
	// state looking valid.
	st.valid = false
	for _, p := range feed {
		if exists[p] {
			st.inSmall[p] = true
		} else {
			delete(st.inSmall, p)
		}
	}
	for _, p := range forceRemove {
		delete(st.inSmall, p)
	}

	spec := sortedKeys(pathspec)
	size := 0
	for _, p := range spec {
		size += len(p) + 1
	}
	if size > maxPathspecBytes {
		return nil, &fallback{"pathspec"}
	}
	res, err := s.diffPaths(ctx, r, head, st.small, spec)
	if err != nil {
		return nil, err
	}
	st.changed = map[string]bool{}
	for _, rec := range res.recs {
		st.changed[rec.src] = true
		st.changed[rec.dst] = true
	}
	st.res, st.head = res, head
	st.valid = true
	return res, nil
}

// diffPaths is git's diff of the sync index small against head limited
// to spec.
func (s *Syncer) diffPaths(ctx context.Context, r repo, head, small string, spec []string) (*prepared, error) {
	if len(spec) == 0 {
		return &prepared{head: head, files: []string{}}, nil
	}
	res, err := s.diffIndex(ctx, r, small, head, spec)
	if errors.Is(err, errOverflow) {
		return nil, &fallback{"too large"}
	}
	return res, err
}

// ignored tells which of paths (untracked files) git ignores.
func (s *Syncer) ignored(ctx context.Context, r repo, paths []string) (map[string]bool, error) {
	in := strings.Join(paths, "\x00") + "\x00"
	out, err := s.run(ctx, gitCall{dir: r.root, stdin: strings.NewReader(in)}, "check-ignore", "--no-index", "-z", "--stdin")
	var ge *gitError
	if err != nil && !(errors.As(err, &ge) && ge.code == 1) { // 1: none ignored
		return nil, fmt.Errorf("read the ignore rules: %w", err)
	}
	ignored := map[string]bool{}
	for _, p := range splitZ(out) {
		ignored[p] = true
	}
	return ignored, nil
}

// verifyFull, for tests, compares an incremental result with a full scan.
func (s *Syncer) verifyFull(ctx context.Context, r repo, head string, inc *prepared) error {
	full, err := s.prepareFull(ctx, r, head)
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	if !bytes.Equal(full.data, inc.data) || strings.Join(full.files, "\x00") != strings.Join(inc.files, "\x00") ||
		strings.Join(full.lfs, "\x00") != strings.Join(inc.lfs, "\x00") {
		return fmt.Errorf("verify: the incremental patch differs from a full scan:\nincremental %v:\n%s\nfull %v:\n%s", inc.files, inc.data, full.files, full.data)
	}
	return nil
}

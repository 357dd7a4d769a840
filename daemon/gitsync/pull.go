package gitsync

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
)

// Pull brings the sandbox's changes since the last Push into repoRoot's
// working tree, in one Runner call (a second one only when the transfer
// broke). The sandbox keeps its files. The patch is applied to the working
// tree only (the user's index is not touched). When it does not apply
// cleanly, nothing is lost: the full patch is saved under
// <git dir>/sandboxd/pulls/, a 3-way merge (on a temporary index) writes
// conflict markers, and failing that `git apply --reject` applies what it can
// and writes .rej files; the error is a *ConflictError. Git LFS files are not
// applied (the saved patch has them). Once the patch is applied or saved,
// the exec is acknowledged, so the next push may reset the sandbox; until
// then the sandbox keeps the edits and the next push brings them back.
func (s *Syncer) Pull(ctx context.Context, r Runner, repoRoot string) (PullResult, error) {
	res := PullResult{Files: []string{}}
	start := time.Now()
	rp, err := s.openRepo(ctx, repoRoot)
	if err != nil {
		return res, repoError(err)
	}
	id, patch, saved, err := s.fetchPull(ctx, r, rp)
	return s.land(ctx, rp, start, id, patch, saved, err)
}

// land applies the patch of exec id that a pull fetched (or notes where it
// was saved, or returns the fetch's error) and acknowledges the exec once
// its edits are applied or saved.
func (s *Syncer) land(ctx context.Context, rp repo, start time.Time, id string, patch []byte, saved string, err error) (PullResult, error) {
	res := PullResult{Files: []string{}, ID: id, SavedPatch: saved}
	if saved != "" {
		s.ack(rp, id)
	}
	if err != nil {
		return res, err
	}
	res.Bytes = len(patch)
	s.pause("pull-before-apply")
	err = s.applyPulled(ctx, rp, patch, &res)
	s.pause("pull-before-ack")
	if err == nil || res.SavedPatch != "" {
		s.ack(rp, id)
	}
	s.log.Debug("sync pulled", "files", len(res.Files), "bytes", res.Bytes, "took", time.Since(start), "err", err)
	return res, err
}

// Save fetches the sandbox's changes since the last Push like Pull, but
// only saves them under <git dir>/sandboxd/pulls/ (nothing is applied) and
// acknowledges them: for an exec whose caller went away, whose edits must
// neither be lost nor land in the working tree unasked. SavedPatch is empty
// when there was nothing to save.
func (s *Syncer) Save(ctx context.Context, r Runner, repoRoot string) (PullResult, error) {
	res := PullResult{Files: []string{}}
	rp, err := s.openRepo(ctx, repoRoot)
	if err != nil {
		return res, repoError(err)
	}
	id, patch, saved, err := s.fetchPull(ctx, r, rp)
	res.ID, res.SavedPatch = id, saved
	if saved != "" {
		s.ack(rp, id)
		return res, nil
	}
	if err != nil {
		return res, err
	}
	res.Bytes = len(patch)
	if len(patch) > 0 {
		if res.SavedPatch, err = s.savePatch(rp, patch); err != nil {
			return res, err
		}
		if files, err := s.patchFiles(ctx, rp.root, patch); err == nil {
			res.Files = files
		}
	}
	s.ack(rp, id)
	return res, nil
}

// recover handles the answer of a push that found the edits of an exec that
// was never pulled to the end: they are applied (or saved) and acknowledged.
// changed reports that the local working tree changed.
func (s *Syncer) recover(ctx context.Context, r Runner, rp repo, out *limitedBuffer, tooLarge bool) (*PullResult, bool, error) {
	res := &PullResult{Files: []string{}}
	if tooLarge {
		id, size, ok := parseHeader(out.buf.Bytes())
		if !ok {
			return res, false, errdefs.Unavailable(newError(ErrTransfer, nil, "the sandbox holds edits of an earlier exec that were never pulled, but its answer does not name a valid exec (something in the sandbox wrote .git/sandboxd/pending?): they stay in the sandbox; `nook reset` drops them"))
		}
		res.ID = id
		saved, err := s.fetchToFile(ctx, r, rp, id, size)
		if err != nil {
			return res, false, errdefs.Unavailable(newError(ErrTransfer, err,
				"the sandbox holds edits of an earlier exec that were never pulled (their pull failed, or the daemon stopped during it), %s, over the %s limit, and copying them here failed (%v): they stay in the sandbox (%s); run the command again",
				formatBytes(size), formatBytes(s.maxBytes), err, keptPatch))
		}
		res.SavedPatch = saved
		s.ack(rp, id)
		res.Warnings = append(res.Warnings, fmt.Sprintf("the sandbox held edits of an earlier exec that were never pulled (their pull failed, or the daemon stopped during it), %s, over the %s limit: not applied, saved at %s (apply with `git apply --3way %s`)",
			formatBytes(size), formatBytes(s.maxBytes), saved, saved))
		return res, false, nil
	}
	id, patch, ok := parsePull(out)
	res.ID = id
	if !ok {
		return res, false, errdefs.Unavailable(newError(ErrTransfer, nil, "the sandbox's unpulled edits of an earlier exec arrived incomplete: they stay in the sandbox; run the command again"))
	}
	res.Bytes = len(patch)
	if len(patch) == 0 {
		s.ack(rp, id)
		return res, false, nil
	}
	// The daemon may have died after applying them but before the
	// acknowledgement: then they apply in reverse.
	if _, err := s.run(ctx, gitCall{dir: rp.root, stdin: bytes.NewReader(patch)}, "apply", "--check", "-"); err != nil {
		if _, rerr := s.run(ctx, gitCall{dir: rp.root, stdin: bytes.NewReader(patch)}, "apply", "-R", "--check", "-"); rerr == nil {
			s.ack(rp, id)
			return res, false, nil
		}
	}
	err := s.applyPulled(ctx, rp, patch, res)
	if res.SavedPatch == "" {
		if saved, serr := s.savePatch(rp, patch); serr == nil {
			res.SavedPatch = saved
		}
	}
	if err == nil || res.SavedPatch != "" {
		s.ack(rp, id)
	}
	msg := fmt.Sprintf("%s; brought back now: %s", recoveredWhat(id), strings.Join(res.Files, ", "))
	var de *DiskFullError
	if errors.As(err, &de) {
		// Nothing was brought back: the error says what is where.
		de.Saved = res.SavedPatch
		if de.Saved == "" {
			return res, false, fmt.Errorf("%s: %w", recoveredWhat(id), err)
		}
		res.Warnings = append(res.Warnings, recoveredWhat(id)+": "+err.Error())
		return res, false, nil
	}
	if res.SavedPatch != "" {
		msg += "; a copy of the patch is at " + res.SavedPatch
	}
	if err != nil {
		msg += fmt.Sprintf("; they did not apply cleanly: %v", err)
	}
	res.Warnings = append(res.Warnings, msg)
	if err != nil && res.SavedPatch == "" {
		return res, true, err
	}
	return res, true, nil
}

// applyPulled applies a patch from the sandbox to the working tree,
// falling back to a 3-way merge and to --reject; every failure path saves
// the patch first (res.SavedPatch).
func (s *Syncer) applyPulled(ctx context.Context, rp repo, patch []byte, res *PullResult) error {
	if len(patch) == 0 {
		return nil
	}
	if err := s.checkGit(ctx); err != nil {
		return s.saveFailed(rp, patch, res, fmt.Errorf("nothing was applied: %w", err))
	}
	entries, refused, err := s.screenPulled(ctx, rp, patch)
	if err != nil {
		return s.saveFailed(rp, patch, res, fmt.Errorf("nothing was applied: %w", err))
	}
	var exclude, files, touched, skipPaths []string
	skip := map[string]bool{}
	for _, r := range refused {
		skip[r.Path] = true
		skipPaths = append(skipPaths, r.Path)
		exclude = append(exclude, "--exclude="+globEscape(r.Path))
	}
	for _, e := range entries {
		if skip[e.path()] {
			continue
		}
		files = append(files, e.path())
		// What applying aside copies first: both names of a rename, once.
		touched = append(touched, e.old, e.new)
	}
	sort.Strings(files)
	sort.Strings(touched)
	touched = slices.Compact(touched)
	if len(touched) > 0 && touched[0] == "" {
		touched = touched[1:]
	}
	if len(refused) > 0 {
		if err := s.refuse(rp, patch, res, refused); err != nil {
			return err
		}
	}
	lfs, err := s.lfsFiles(ctx, rp.root, files)
	if err != nil {
		return s.saveFailed(rp, patch, res, err)
	}
	res.Files = without(files, lfs)
	res.SkippedLFS = lfs
	for _, f := range lfs {
		exclude = append(exclude, "--exclude="+globEscape(f))
	}
	if len(files) == 0 {
		return nil
	}
	defer s.recheckApplied(rp, patch, res)
	if len(lfs) > 0 {
		if res.SavedPatch, err = s.savePatch(rp, patch); err != nil {
			return err
		}
		res.Warnings = append(res.Warnings, fmt.Sprintf("the sandbox changed %d Git LFS file(s), not applied locally: %s; the full patch is saved at %s",
			len(lfs), strings.Join(lfs, ", "), res.SavedPatch))
	}

	apply := func(index string, extra ...string) (string, error) {
		args := append([]string{"apply", "--whitespace=nowarn"}, extra...)
		args = append(args, exclude...)
		args = append(args, "-")
		_, err := s.run(ctx, gitCall{dir: rp.root, index: index, stdin: bytes.NewReader(patch)}, args...)
		var ge *gitError
		if errors.As(err, &ge) {
			return strings.TrimSpace(ge.stderr), err
		}
		return "", err
	}
	// Applied aside first: a full disk fails before the tree is touched.
	var de *DiskFullError
	switch err := s.applyAside(ctx, rp, patch, touched, append(skipPaths, lfs...)); {
	case err == nil:
		return nil
	case errors.As(err, &de):
		if de.Saved == "" {
			de.Saved = res.SavedPatch
		}
		res.SavedPatch = de.Saved
		return de
	case ctx.Err() != nil:
		return s.saveFailed(rp, patch, res, err)
	case errors.Is(err, errNotAside):
		if _, err := apply(""); err == nil {
			return nil
		} else if ctx.Err() != nil {
			return s.saveFailed(rp, patch, res, err)
		}
	}

	// A local change made during the exec is in the way.
	if res.SavedPatch == "" {
		if res.SavedPatch, err = s.savePatch(rp, patch); err != nil {
			return err
		}
	}
	conflicts, detail, err := s.applyThreeWay(ctx, rp, apply)
	if err != nil {
		return s.saveFailed(rp, patch, res, err)
	}
	if conflicts != nil && len(conflicts) == 0 {
		// Merged cleanly: nothing to resolve, the saved copy is not needed.
		if len(lfs) == 0 && len(refused) == 0 {
			_ = os.Remove(res.SavedPatch)
			res.SavedPatch = ""
		}
		return nil
	}
	ce := &ConflictError{SavedPatch: res.SavedPatch, ConflictFiles: conflicts}
	if conflicts == nil {
		// The merge could not even start: apply what applies, hunk by hunk.
		rejStart := time.Now().Add(-time.Second) // file times are wall-clock
		msg, err := apply("", "--reject")
		if err == nil {
			if len(lfs) == 0 && len(refused) == 0 {
				_ = os.Remove(res.SavedPatch)
				res.SavedPatch = ""
			}
			return nil
		}
		ce.RejectFiles = rejFiles(rp.root, files, rejStart)
		ce.Detail = gitDetail(msg)
		if len(ce.RejectFiles) == 0 && ce.Detail == "" {
			ce.Detail = gitDetail(detail)
		}
	}
	res.ConflictFiles, res.RejectFiles = ce.ConflictFiles, ce.RejectFiles
	if err := recordUnresolved(rp, unresolved{Patch: ce.SavedPatch, Conflicts: ce.ConflictFiles, Rejects: ce.RejectFiles}); err != nil {
		s.log.Warn("record unresolved pull", "err", err)
	}
	return errdefs.Conflict(ce)
}

// refuse saves the patch (when not yet saved) and tells the user which of
// its entries were not applied, and why.
func (s *Syncer) refuse(rp repo, patch []byte, res *PullResult, refused []Refused) error {
	if res.SavedPatch == "" {
		saved, err := s.savePatch(rp, patch)
		if err != nil {
			return err
		}
		res.SavedPatch = saved
	}
	res.Refused = append(res.Refused, refused...)
	parts := make([]string, 0, len(refused))
	for _, r := range refused {
		parts = append(parts, fmt.Sprintf("%s (%s)", strconv.QuoteToGraphic(r.Path), r.Reason))
	}
	res.Warnings = append(res.Warnings, fmt.Sprintf("sandboxd refused %d of the sandbox's changes, not applied here: %s; the full patch is saved at %s",
		len(refused), strings.Join(parts, "; "), res.SavedPatch))
	return nil
}

// recheckApplied looks at the symlinks the pull wrote, in case git read
// the patch otherwise than screenPulled: one that points out of the
// checkout is removed and reported.
func (s *Syncer) recheckApplied(rp repo, patch []byte, res *PullResult) {
	var refused []Refused
	for _, f := range res.Files {
		p := filepath.Join(rp.root, filepath.FromSlash(f))
		fi, err := os.Lstat(p)
		if err != nil || fi.Mode()&os.ModeSymlink == 0 {
			continue
		}
		t, err := os.Readlink(p)
		if err != nil {
			continue
		}
		if why := screenLink(rp.root, pulledEntry{new: f, mode: "120000", target: t, known: true}); why != "" {
			if err := os.Remove(p); err != nil {
				s.log.Warn("remove a refused symlink", "path", p, "err", err)
			}
			refused = append(refused, Refused{Path: f, Reason: why})
		}
	}
	if len(refused) > 0 {
		res.Files = without(res.Files, refusedPaths(refused))
		if err := s.refuse(rp, patch, res, refused); err != nil {
			s.log.Warn("report refused symlinks", "err", err)
		}
	}
}

func refusedPaths(r []Refused) []string {
	out := make([]string, len(r))
	for i, x := range r {
		out[i] = x.Path
	}
	return out
}

// applyThreeWay runs `git apply --3way` against a temporary index holding
// the working tree, so the user's index is untouched. conflicts is nil when
// the merge could not be done at all (nothing was written), empty when it
// merged cleanly, else the files left with conflict markers.
func (s *Syncer) applyThreeWay(ctx context.Context, rp repo, apply func(index string, extra ...string) (string, error)) (conflicts []string, detail string, err error) {
	index, cleanup, err := rp.tempIndex()
	if err != nil {
		return nil, "", err
	}
	defer cleanup()
	if _, err := s.run(ctx, gitCall{dir: rp.root, index: index}, "add", "-A"); err != nil {
		return nil, "", fmt.Errorf("stage the working tree for a 3-way merge: %w", err)
	}
	detail, aerr := apply(index, "--3way")
	if aerr == nil {
		return []string{}, "", nil
	}
	out, err := s.run(ctx, gitCall{dir: rp.root, index: index}, "ls-files", "-u", "-z")
	if err != nil {
		return nil, "", fmt.Errorf("list merge conflicts: %w", err)
	}
	seen := map[string]bool{}
	for _, rec := range splitZ(out) {
		// "<mode> <object> <stage>\t<path>"
		if _, path, ok := strings.Cut(rec, "\t"); ok {
			seen[path] = true
		}
	}
	if len(seen) == 0 {
		return nil, detail, nil
	}
	return sortedKeys(seen), detail, nil
}

// patchFiles lists the paths a patch changes (new side of renames).
func (s *Syncer) patchFiles(ctx context.Context, dir string, patch []byte) ([]string, error) {
	out, err := s.run(ctx, gitCall{dir: dir, stdin: bytes.NewReader(patch)}, "apply", "--numstat", "-z", "-")
	if err != nil {
		return nil, err
	}
	return numstatFiles(out), nil
}

// numstatFiles parses `git apply --numstat -z`: records
// "added\tdeleted\tpath\0", or for a rename "added\tdeleted\t\0old\0new\0".
// The patch comes from the sandbox, so the output is not trusted to be
// well formed: what does not parse is skipped, never a panic.
func numstatFiles(out []byte) []string {
	var files []string
	f := splitZ(out)
	for i := 0; i < len(f); i++ {
		parts := strings.SplitN(f[i], "\t", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[2] != "" {
			files = append(files, parts[2])
			continue
		}
		if i+2 < len(f) && f[i+2] != "" {
			files = append(files, f[i+2])
		}
		i += 2
	}
	sort.Strings(files)
	return files
}

// savePatch keeps a pulled patch under <git dir>/sandboxd/pulls/.
func (s *Syncer) savePatch(rp repo, patch []byte) (string, error) {
	dir := filepath.Join(rp.stateDir(), "pulls")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("save the sandbox's patch: %w", err)
	}
	name := filepath.Join(dir, s.now().UTC().Format("20060102T150405Z")+"-"+newID()[:6]+".patch")
	// Written aside and renamed: a full disk leaves no empty or partial
	// patch file behind.
	tmp := name + ".tmp"
	if err := os.WriteFile(tmp, patch, 0o644); err != nil {
		_ = os.Remove(tmp)
		return "", fmt.Errorf("save the sandbox's patch to %s: %w", name, err)
	}
	if err := os.Rename(tmp, name); err != nil {
		_ = os.Remove(tmp)
		return "", fmt.Errorf("save the sandbox's patch to %s: %w", name, err)
	}
	return name, nil
}

// saveFailed saves the patch (when not yet saved) and says where it is.
func (s *Syncer) saveFailed(rp repo, patch []byte, res *PullResult, cause error) error {
	if res.SavedPatch == "" {
		p, err := s.savePatch(rp, patch)
		if err != nil {
			return fmt.Errorf("%w; and the sandbox's patch could not be saved: %v", cause, err)
		}
		res.SavedPatch = p
	}
	return fmt.Errorf("apply the sandbox's changes: %w; the full patch is saved at %s (apply it with `git apply --3way %s`)", cause, res.SavedPatch, res.SavedPatch)
}

// rejFiles lists the .rej files `git apply --reject` wrote for files.
func rejFiles(root string, files []string, since time.Time) []string {
	var out []string
	for _, f := range files {
		fi, err := os.Stat(filepath.Join(root, f+".rej"))
		if err == nil && !fi.ModTime().Before(since) {
			out = append(out, f+".rej")
		}
	}
	return out
}

// gitDetail keeps git's error lines, which name the files that applied
// neither way.
func gitDetail(stderr string) string {
	var keep []string
	for _, l := range strings.Split(stderr, "\n") {
		// "while searching for:" introduces context lines, not a cause.
		if msg, ok := strings.CutPrefix(l, "error: "); ok && !strings.HasSuffix(msg, ":") {
			keep = append(keep, msg)
		}
	}
	return strings.Join(keep, "; ")
}

// globEscape quotes a path for git apply's --exclude pattern.
func globEscape(p string) string {
	var b strings.Builder
	for _, r := range p {
		if strings.ContainsRune(`\*?[`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// Unpulled lists the files whose edits the sandbox holds that no pull
// brought back (an exec's, or made outside one: see strayEdits), without
// applying or acknowledging anything: what ending the sandbox now drops.
// A patch over the size limit is saved (saved names it), not dropped.
func (s *Syncer) Unpulled(ctx context.Context, r Runner, repoRoot string) (files []string, saved string, err error) {
	rp, err := s.openRepo(ctx, repoRoot)
	if err != nil {
		return nil, "", repoError(err)
	}
	_, patch, saved, err := s.fetchPull(ctx, r, rp)
	if saved != "" || err != nil {
		return nil, saved, err
	}
	if len(patch) == 0 {
		return []string{}, "", nil
	}
	files, err = s.patchFiles(ctx, rp.root, patch)
	if err != nil {
		return nil, "", fmt.Errorf("list the sandbox's unpulled edits: %w", err)
	}
	return files, "", nil
}

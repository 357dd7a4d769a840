package gitsync

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// DiskFullError is a pull that found no room on the local disk: nothing of
// the patch was applied (the working tree is as it was) and Saved says
// where the patch is, or is empty when it could not be saved either (then
// the edits stay in the sandbox, unacknowledged, and the next exec or push
// brings them back).
type DiskFullError struct {
	Dir   string // the directory whose filesystem is full
	Need  int64  // about how many bytes the pull needs there
	Saved string
	Cause error
}

func (e *DiskFullError) Error() string {
	where := "they stay in the sandbox and the next exec or `nook push` brings them back"
	if e.Saved != "" {
		where = fmt.Sprintf("the full patch is saved at %s (apply it with `git apply --3way %s` once there is room)", e.Saved, e.Saved)
	}
	return fmt.Sprintf("no space left on the disk of %s to apply the sandbox's changes (%v): nothing was applied and your working tree is as it was; %s; free at least %s there (`df -h %s` shows the room)",
		e.Dir, e.Cause, where, formatBytes(e.Need), e.Dir)
}

func (e *DiskFullError) Unwrap() error { return e.Cause }

// NoRetryHint: running the command again fails the same way until space
// is freed, so it is not called safe to retry.
func (e *DiskFullError) NoRetryHint() bool { return true }

// diskFull reports whether err (or a git's stderr in it) says the disk or
// the quota is full.
func diskFull(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
		return true
	}
	msg := err.Error()
	return strings.Contains(msg, "No space left on device") || strings.Contains(msg, "Disk quota exceeded")
}

// errNotAside says that the patch cannot be applied aside safely (a path
// through a symbolic link, a path git would refuse): the caller applies it
// in place, as git apply checks those itself.
var errNotAside = errors.New("the patch is not applied aside")

// applyAside applies the patch to copies of the files it touches (paths:
// both names of a rename), in a scratch directory of the git directory, then
// moves the results into the working tree by renames: a disk that fills
// up fails before the tree is touched. It returns errNotAside when the patch must be applied in
// place, a *gitError when it does not apply (a conflict), a *DiskFullError
// (Saved empty) when the disk is full.
func (s *Syncer) applyAside(ctx context.Context, rp repo, patch []byte, paths, skip []string) error {
	skipped := map[string]bool{}
	for _, p := range skip {
		skipped[p] = true
	}
	for _, p := range paths {
		if !asidePath(rp.root, p) {
			return errNotAside
		}
	}
	if err := os.MkdirAll(rp.stateDir(), 0o755); err != nil {
		return s.asideFailed(rp, patch, err)
	}
	scratch, err := os.MkdirTemp(rp.stateDir(), "apply-")
	if err != nil {
		return s.asideFailed(rp, patch, err)
	}
	defer os.RemoveAll(scratch)
	for _, p := range paths {
		if err := copyEntry(filepath.Join(rp.root, p), filepath.Join(scratch, p)); err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				continue
			}
			return s.asideFailed(rp, patch, err)
		}
	}
	args := []string{"apply", "--whitespace=nowarn"}
	for _, p := range skip {
		args = append(args, "--exclude="+globEscape(p))
	}
	if _, err := s.run(ctx, gitCall{dir: scratch, stdin: bytes.NewReader(patch)}, append(args, "-")...); err != nil {
		if diskFull(err) {
			return s.asideFailed(rp, patch, err)
		}
		return err
	}
	return s.moveIn(rp, patch, scratch, paths, skipped)
}

// moveIn moves the scratch results over the working tree: every new
// content is first complete next to its target, then all are renamed, then
// the deleted files go.
func (s *Syncer) moveIn(rp repo, patch []byte, scratch string, paths []string, skipped map[string]bool) error {
	type move struct{ from, to string }
	var moves []move
	var deletes []string
	var made []string // directories created, removed again on failure
	cleanup := func() {
		for _, m := range moves {
			_ = os.Remove(m.from)
		}
		for i := len(made) - 1; i >= 0; i-- {
			_ = os.Remove(made[i])
		}
	}
	for _, p := range paths {
		if skipped[p] {
			continue
		}
		src, dst := filepath.Join(scratch, p), filepath.Join(rp.root, p)
		if _, err := os.Lstat(src); errors.Is(err, fs.ErrNotExist) {
			if _, err := os.Lstat(dst); err == nil {
				deletes = append(deletes, dst)
			}
			continue
		}
		dirs, err := mkdirs(rp.root, filepath.Dir(p))
		made = append(made, dirs...)
		if err != nil {
			cleanup()
			return s.asideFailed(rp, patch, err)
		}
		tmp := filepath.Join(filepath.Dir(dst), "."+filepath.Base(dst)+".sandboxd-"+newID()[:8])
		moves = append(moves, move{tmp, dst})
		// The scratch directory is on the tree's filesystem as a rule: a
		// rename needs no room; else the content is copied beside.
		if err := os.Rename(src, tmp); err != nil {
			if err := copyEntry(src, tmp); err != nil {
				cleanup()
				return s.asideFailed(rp, patch, err)
			}
		}
	}
	for _, m := range moves {
		if err := os.Rename(m.from, m.to); err != nil {
			// Renames need no room; one that fails leaves the rest of the
			// new content beside its targets, named in the error.
			return fmt.Errorf("move the pulled %s into place: %w", m.to, err)
		}
	}
	for _, d := range deletes {
		if err := os.Remove(d); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("remove %s, deleted in the sandbox: %w", d, err)
		}
		// git apply removes the directories a deletion empties.
		for dir := filepath.Dir(d); dir != rp.root && strings.HasPrefix(dir, rp.root); dir = filepath.Dir(dir) {
			if os.Remove(dir) != nil {
				break
			}
		}
	}
	return nil
}

// asideFailed turns a failure before the working tree was touched into the
// error to report: a full disk is a DiskFullError, with the patch saved if
// there is room for it.
func (s *Syncer) asideFailed(rp repo, patch []byte, err error) error {
	if !diskFull(err) {
		return fmt.Errorf("prepare the sandbox's changes beside the working tree: %w", err)
	}
	de := &DiskFullError{Dir: rp.root, Need: int64(len(patch)) * 2, Cause: err}
	if saved, serr := s.savePatch(rp, patch); serr == nil {
		de.Saved = saved
	}
	return de
}

// asidePath reports whether p can be applied aside: relative, clean, not
// in .git, and not under a symbolic link or a non-directory of the tree.
func asidePath(root, p string) bool {
	if p == "" || filepath.IsAbs(p) || filepath.Clean(p) != p || p == ".." || strings.HasPrefix(p, "../") {
		return false
	}
	parts := strings.Split(p, "/")
	if strings.EqualFold(parts[0], ".git") {
		return false
	}
	dir := root
	for _, c := range parts[:len(parts)-1] {
		dir = filepath.Join(dir, c)
		fi, err := os.Lstat(dir)
		if errors.Is(err, fs.ErrNotExist) {
			return true
		}
		if err != nil || !fi.IsDir() {
			return false
		}
	}
	fi, err := os.Lstat(filepath.Join(root, p))
	return err != nil || fi.Mode().IsRegular() || fi.Mode()&fs.ModeSymlink != 0
}

// mkdirs creates rel's missing directories under root and returns them,
// outermost first.
func mkdirs(root, rel string) ([]string, error) {
	var made []string
	dir := root
	if rel == "." {
		return nil, nil
	}
	for _, c := range strings.Split(rel, "/") {
		dir = filepath.Join(dir, c)
		if err := os.Mkdir(dir, 0o755); err == nil {
			made = append(made, dir)
		} else if !errors.Is(err, fs.ErrExist) {
			return made, err
		}
	}
	return made, nil
}

// copyEntry copies a regular file (with its mode) or a symbolic link from
// src to dst, creating dst's directory. A partial dst is removed.
func copyEntry(src, dst string) (err error) {
	fi, err := os.Lstat(src)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	if fi.Mode()&fs.ModeSymlink != 0 {
		target, err := os.Readlink(src)
		if err != nil {
			return err
		}
		return os.Symlink(target, dst)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file", src)
	}
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, fi.Mode().Perm())
	if err != nil {
		return err
	}
	defer func() {
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			_ = os.Remove(dst)
		}
	}()
	if _, err := io.Copy(out, in); err != nil {
		return err
	}
	return out.Chmod(fi.Mode().Perm())
}

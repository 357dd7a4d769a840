// Package repofile is the one place the daemon reads files of the user's
// repository that it hashes or uploads (sandbox configs, the .rwx directory,
// the RWX CLI's sandboxes.json). A repository is untrusted input: a cloned
// repository may commit a symlink to /dev/zero, a FIFO or /etc/shadow. So
// every read here resolves inside the repository root only (through os.Root,
// which refuses any path or symlink leaving it), accepts regular files only
// (opened non-blocking, so a FIFO never blocks), and reads at most a bounded
// number of bytes, checking the caller's context between chunks.
package repofile

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/sandboxd/sandboxd/errdefs"
)

// Limits on what is read of a repository. A sandbox config is a few KiB;
// these leave room for generous configs while keeping a hostile or mistaken
// file from costing memory or an upload of gigabytes.
const (
	MaxFileBytes = 1 << 20 // one file (a config, a file of .rwx, sandboxes.json)
	MaxDirBytes  = 5 << 20 // all files of the uploaded .rwx directory together
)

// chunk is how much is read between two checks of the context.
const chunk = 64 << 10

// ReadFile reads the file name (absolute, or relative to root) of the
// repository at root. It fails with an errdefs.ErrInvalid error when name is
// outside root or resolves (through symlinks) outside it, or is not a
// regular file; with errdefs.ErrTooLarge when it holds more than limit bytes;
// and with an error satisfying errors.Is(err, fs.ErrNotExist) when it does
// not exist.
func ReadFile(ctx context.Context, root, name string, limit int64) ([]byte, error) {
	r, rel, err := openRoot(root, name)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	return read(ctx, r, root, rel, limit)
}

// Entry is one entry of a directory read by ReadDir.
type Entry struct {
	Path string      // slash-separated, relative to the directory read
	Dir  bool        // a directory (Data is nil)
	Perm fs.FileMode // permission bits
	Data []byte      // the contents of a file
}

// ReadDir reads the directory dir of the repository at root recursively:
// every directory and regular file, with the contents of the files, at most
// MaxFileBytes each and MaxDirBytes in all. Directories named in skip
// (relative to dir) are left out. A symlink whose target is a regular file
// inside the repository is read as that file; a symlink leading outside the
// repository is refused with an error naming it; other entries (sockets,
// FIFOs, devices, links to directories or to nothing) are skipped.
func ReadDir(ctx context.Context, root, dir string, skip ...string) ([]Entry, error) {
	r, relDir, err := openRoot(root, dir)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	if st, err := r.Stat(relDir); err != nil {
		return nil, describe(root, relDir, err)
	} else if !st.IsDir() {
		return nil, errdefs.Invalidf("%s is not a directory", filepath.Join(root, relDir))
	}
	var entries []Entry
	total := int64(0)
	err = fs.WalkDir(r.FS(), filepath.ToSlash(relDir), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return describe(root, filepath.FromSlash(p), err)
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, _ := filepath.Rel(relDir, filepath.FromSlash(p))
		if rel == "." {
			return nil
		}
		rel = filepath.ToSlash(rel)
		for _, s := range skip {
			if d.IsDir() && rel == s {
				return fs.SkipDir
			}
		}
		switch {
		case d.IsDir():
			info, err := d.Info()
			if err != nil {
				return describe(root, filepath.FromSlash(p), err)
			}
			entries = append(entries, Entry{Path: rel, Dir: true, Perm: info.Mode().Perm()})
			return nil
		case d.Type()&fs.ModeSymlink != 0:
			// Read through the link only when its target is a regular file
			// inside the repository; os.Root refuses any other target.
			st, err := r.Stat(filepath.FromSlash(p))
			if err != nil {
				if errors.Is(err, fs.ErrNotExist) {
					return nil // a dangling link uploads nothing
				}
				return describe(root, filepath.FromSlash(p), err)
			}
			if !st.Mode().IsRegular() {
				return nil
			}
		case !d.Type().IsRegular():
			return nil
		}
		b, err := read(ctx, r, root, filepath.FromSlash(p), min(MaxFileBytes, MaxDirBytes-total))
		if err != nil {
			if errdefs.KindOf(err) == errdefs.KindTooLarge && total > 0 {
				return errdefs.TooLarge(fmt.Errorf("the directory %s holds more than %d MiB of files (at %s): sandboxd uploads it with every new sandbox; move large files out of it",
					filepath.Join(root, relDir), MaxDirBytes>>20, filepath.Join(root, filepath.FromSlash(p))))
			}
			return err
		}
		total += int64(len(b))
		st, err := r.Stat(filepath.FromSlash(p))
		if err != nil {
			return describe(root, filepath.FromSlash(p), err)
		}
		entries = append(entries, Entry{Path: rel, Perm: st.Mode().Perm(), Data: b})
		return nil
	})
	if err != nil {
		return nil, err
	}
	return entries, nil
}

// openRoot opens root as an os.Root and returns name relative to it.
func openRoot(root, name string) (*os.Root, string, error) {
	rel := name
	if filepath.IsAbs(name) {
		var err error
		if rel, err = filepath.Rel(root, name); err != nil || rel == ".." || strings.HasPrefix(rel, ".."+string(filepath.Separator)) {
			return nil, "", errdefs.Invalidf("%s is outside the repository %s: sandboxd reads only files inside the repository", name, root)
		}
	}
	r, err := os.OpenRoot(root)
	if err != nil {
		return nil, "", fmt.Errorf("open the repository %s: %w", root, err)
	}
	return r, rel, nil
}

// read reads the regular file rel of r, at most limit bytes.
func read(ctx context.Context, r *os.Root, root, rel string, limit int64) ([]byte, error) {
	// O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused
	// just below); it changes nothing for a regular file.
	f, err := r.OpenFile(rel, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, describe(root, rel, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", filepath.Join(root, rel), err)
	}
	if st.IsDir() {
		return nil, errdefs.Invalidf("%s is a directory, not a file: name the YAML file (for example .rwx/sandbox.yml)", filepath.Join(root, rel))
	}
	if !st.Mode().IsRegular() {
		return nil, errdefs.Invalidf("%s is not a regular file (%s): sandboxd reads only regular files of the repository; replace it with a file", filepath.Join(root, rel), typeName(st.Mode()))
	}
	tooLarge := func() error {
		return errdefs.TooLarge(fmt.Errorf("%s is larger than the %d KiB limit for a file sandboxd reads from the repository: keep sandbox configs and the files of their directory small (move large files out of it)",
			filepath.Join(root, rel), limit>>10))
	}
	if st.Size() > limit {
		return nil, tooLarge()
	}
	var buf []byte
	for {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("read %s: %w", filepath.Join(root, rel), err)
		}
		// One byte past the limit tells a file that grew while being read.
		n := min(int64(chunk), limit+1-int64(len(buf)))
		if n <= 0 {
			return nil, tooLarge()
		}
		b := make([]byte, n)
		k, err := io.ReadFull(f, b)
		buf = append(buf, b[:k]...)
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			if int64(len(buf)) > limit {
				return nil, tooLarge()
			}
			return buf, nil
		}
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", filepath.Join(root, rel), err)
		}
	}
}

// describe turns an os.Root error into one that says what to do, keeping
// fs.ErrNotExist visible to errors.Is.
func describe(root, rel string, err error) error {
	full := filepath.Join(root, rel)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%s: %w", full, err)
	}
	if isEscape(err) {
		target, terr := filepath.EvalSymlinks(full)
		if terr != nil {
			target = "a path"
		} else if rel, rerr := filepath.Rel(root, target); rerr == nil && rel != ".." && !strings.HasPrefix(rel, ".."+string(filepath.Separator)) {
			return errdefs.Invalidf("%s is a symbolic link with an absolute target (%s): sandboxd follows only relative links inside the repository; make the link relative", full, target)
		}
		return errdefs.Invalidf("%s leads to %s, outside the repository %s: sandboxd reads and uploads only files inside the repository; replace the symbolic link with a copy of the file", full, target, root)
	}
	return fmt.Errorf("read %s: %w", full, err)
}

// isEscape reports whether err is os.Root refusing a path that leaves it.
func isEscape(err error) bool {
	var pe *fs.PathError
	return errors.As(err, &pe) && strings.Contains(pe.Err.Error(), "escapes")
}

func typeName(m fs.FileMode) string {
	switch {
	case m&fs.ModeNamedPipe != 0:
		return "a FIFO"
	case m&fs.ModeSocket != 0:
		return "a socket"
	case m&fs.ModeDevice != 0:
		return "a device"
	case m&fs.ModeIrregular != 0:
		return "an irregular file"
	}
	return m.Type().String()
}

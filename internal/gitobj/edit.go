package gitobj

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Change sets one path (slash-separated, relative, no "." or ".." or empty
// components, no leading or trailing slash) to Mode and OID; Mode 0 deletes
// whatever is at the path (a file, or a whole subtree).
type Change struct {
	Path string
	Mode uint32
	OID  OID
}

// editDir is a directory being edited. Its entries are loaded from base
// only when a change reaches it, which keeps an edit proportional to the
// paths it touches.
type editDir struct {
	base    OID
	entries map[string]*editItem // nil until loaded
	dirty   bool
}

type editItem struct {
	mode uint32
	oid  OID
	dir  *editDir // set once a tree entry has been descended into
}

// EditTree applies changes, in order, to the tree base (the zero OID is the
// empty tree) and returns the new root tree, writing every new tree object.
//
// Only the trees along the changed paths are read. Missing intermediate
// directories are created; a directory left empty is removed, and an empty
// root is the (written) empty tree. A change below a path that is a file
// replaces the file with a directory, and a file change at a path that is a
// directory replaces the whole subtree, as git's index does; when changes
// conflict that way the later one wins. Deleting a path that does not exist
// is not an error. Invalid paths (including a ".git" component, which git
// refuses to check out), Mode==ModeTree, unknown modes and a zero OID with a
// non-zero Mode are errors, reported before anything is written.
func (s *Store) EditTree(ctx context.Context, base OID, changes []Change) (OID, error) {
	for _, ch := range changes {
		if err := checkChange(ch); err != nil {
			return OID{}, fmt.Errorf("gitobj: edit tree: %w", err)
		}
	}
	root := &editDir{base: base}
	for _, ch := range changes {
		if err := s.apply(ctx, root, ch); err != nil {
			return OID{}, fmt.Errorf("gitobj: edit tree %s: change %q: %w", base, ch.Path, err)
		}
	}
	if !root.dirty && !base.IsZero() {
		return base, nil
	}
	oid, err := s.flush(root)
	if err != nil {
		return OID{}, fmt.Errorf("gitobj: edit tree %s: %w", base, err)
	}
	if oid.IsZero() {
		// Git never stores an empty subtree, but the root has to be some
		// object, and callers may hand it to git, which needs it on disk.
		if oid, err = s.write("tree", nil); err != nil {
			return OID{}, fmt.Errorf("gitobj: edit tree %s: %w", base, err)
		}
	}
	return oid, nil
}

func checkChange(ch Change) error {
	if err := checkPath(ch.Path); err != nil {
		return err
	}
	for _, c := range strings.Split(ch.Path, "/") {
		if strings.EqualFold(c, ".git") {
			return fmt.Errorf("path %q: .git component", ch.Path)
		}
	}
	switch ch.Mode {
	case 0:
	case ModeFile, ModeExec, ModeSymlink, ModeGitlink:
		if ch.OID.IsZero() {
			return fmt.Errorf("path %q: zero object id", ch.Path)
		}
	case ModeTree:
		return fmt.Errorf("path %q: cannot set a tree entry", ch.Path)
	default:
		return fmt.Errorf("path %q: unsupported mode %o", ch.Path, ch.Mode)
	}
	return nil
}

// checkPath enforces the path syntax shared by EditTree and Lookup.
func checkPath(p string) error {
	if p == "" {
		return errors.New("empty path")
	}
	if strings.IndexByte(p, 0) >= 0 {
		return fmt.Errorf("path %q: contains NUL", p)
	}
	for _, c := range strings.Split(p, "/") {
		if c == "" || c == "." || c == ".." {
			return fmt.Errorf("path %q: invalid component %q", p, c)
		}
	}
	return nil
}

// load fills d.entries from d.base on first use.
func (s *Store) load(ctx context.Context, d *editDir) error {
	if d.entries != nil {
		return nil
	}
	entries, err := s.readTree(ctx, d.base)
	if err != nil {
		return err
	}
	d.entries = make(map[string]*editItem, len(entries)+1)
	for _, e := range entries {
		d.entries[e.Name] = &editItem{mode: e.Mode, oid: e.OID}
	}
	return nil
}

// apply records one change in the edit tree rooted at root.
func (s *Store) apply(ctx context.Context, root *editDir, ch Change) error {
	names := strings.Split(ch.Path, "/")
	chain := make([]*editDir, 0, len(names))
	d := root
	for _, name := range names[:len(names)-1] {
		chain = append(chain, d)
		if err := s.load(ctx, d); err != nil {
			return err
		}
		it := d.entries[name]
		if it == nil || it.mode != ModeTree {
			if ch.Mode == 0 {
				return nil // nothing can exist below a missing path or a file
			}
			// A file (or nothing) in the way becomes a new directory.
			it = &editItem{mode: ModeTree, dir: &editDir{entries: map[string]*editItem{}}}
			d.entries[name] = it
		}
		if it.dir == nil {
			it.dir = &editDir{base: it.oid}
		}
		d = it.dir
	}
	chain = append(chain, d)
	if err := s.load(ctx, d); err != nil {
		return err
	}
	last := names[len(names)-1]
	if ch.Mode == 0 {
		if _, ok := d.entries[last]; !ok {
			return nil
		}
		delete(d.entries, last)
	} else {
		// Replacing a tree drops its subtree, as the index would.
		d.entries[last] = &editItem{mode: ch.Mode, oid: ch.OID}
	}
	for _, c := range chain {
		c.dirty = true
	}
	return nil
}

// flush writes the dirty directory d and its dirty descendants, returning
// d's tree id, or the zero OID if d ended up empty (and so is dropped).
func (s *Store) flush(d *editDir) (OID, error) {
	if !d.dirty {
		return d.base, nil
	}
	entries := make([]Entry, 0, len(d.entries))
	for name, it := range d.entries {
		oid := it.oid
		if it.mode == ModeTree {
			if it.dir != nil {
				var err error
				if oid, err = s.flush(it.dir); err != nil {
					return OID{}, err
				}
			}
			// The index cannot hold an empty directory, so neither can a
			// tree written from one.
			if oid.IsZero() || oid == emptyTreeOID {
				continue
			}
		}
		entries = append(entries, Entry{Name: name, Mode: it.mode, OID: oid})
	}
	if len(entries) == 0 {
		return OID{}, nil
	}
	slices.SortFunc(entries, compareEntries)
	oid, err := s.write("tree", formatSorted(entries))
	if err == nil {
		// The next diff or lookup starts from this tree: no reading it back.
		s.cachePut(oid, entries)
	}
	return oid, err
}

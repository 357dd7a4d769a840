package gitobj

import (
	"context"
	"fmt"
	"strings"
)

// Diff is one file-level difference between two trees; Old or New is the
// zero Entry (Mode 0) where the path is absent. Entry.Name is the base name.
type Diff struct {
	Path     string
	Old, New Entry
}

// DiffTrees lists the differing non-tree entries of a and b (either may be
// the zero OID for the empty tree) in git's path order, the order of
// `git diff-tree -r`, descending only into subtrees whose ids differ. A path
// that is a file on one side and a tree on the other gives the file's
// removal or addition plus every file of the subtree. A change of type
// between non-tree entries (file, symlink, gitlink) is one Diff.
func (s *Store) DiffTrees(ctx context.Context, a, b OID) ([]Diff, error) {
	var out []Diff
	if err := s.diff(ctx, "", a, b, &out); err != nil {
		return nil, fmt.Errorf("gitobj: diff trees %s %s: %w", a, b, err)
	}
	return out, nil
}

func (s *Store) diff(ctx context.Context, prefix string, a, b OID, out *[]Diff) error {
	if a == b {
		return nil
	}
	ea, err := s.readTree(ctx, a)
	if err != nil {
		return err
	}
	eb, err := s.readTree(ctx, b)
	if err != nil {
		return err
	}
	// Both lists are in git's order, so one merge pass pairs them up and
	// emits paths in that order too.
	i, j := 0, 0
	for i < len(ea) || j < len(eb) {
		c := 0
		switch {
		case i == len(ea):
			c = 1
		case j == len(eb):
			c = -1
		default:
			c = compareEntries(ea[i], eb[j])
		}
		switch {
		case c < 0:
			if err := s.diffOneSide(ctx, prefix, ea[i], true, out); err != nil {
				return err
			}
			i++
		case c > 0:
			if err := s.diffOneSide(ctx, prefix, eb[j], false, out); err != nil {
				return err
			}
			j++
		default:
			x, y := ea[i], eb[j]
			if x.Mode == ModeTree {
				if err := s.diff(ctx, prefix+x.Name+"/", x.OID, y.OID, out); err != nil {
					return err
				}
			} else if x.Mode != y.Mode || x.OID != y.OID {
				*out = append(*out, Diff{Path: prefix + x.Name, Old: x, New: y})
			}
			i++
			j++
		}
	}
	return nil
}

// diffOneSide reports e, present only on the old (or new) side, recursing
// through it if it is a tree.
func (s *Store) diffOneSide(ctx context.Context, prefix string, e Entry, old bool, out *[]Diff) error {
	if e.Mode == ModeTree {
		if old {
			return s.diff(ctx, prefix+e.Name+"/", e.OID, OID{}, out)
		}
		return s.diff(ctx, prefix+e.Name+"/", OID{}, e.OID, out)
	}
	d := Diff{Path: prefix + e.Name}
	if old {
		d.Old = e
	} else {
		d.New = e
	}
	*out = append(*out, d)
	return nil
}

// Lookup finds path in tree (the zero OID is the empty tree), reading one
// tree per component; ok is false when the path is absent, including when a
// component before the last is not a directory.
func (s *Store) Lookup(ctx context.Context, tree OID, path string) (e Entry, ok bool, err error) {
	if err := checkPath(path); err != nil {
		return Entry{}, false, fmt.Errorf("gitobj: lookup: %w", err)
	}
	names := strings.Split(path, "/")
	cur := tree
	for i, name := range names {
		entries, err := s.readTree(ctx, cur)
		if err != nil {
			return Entry{}, false, fmt.Errorf("gitobj: lookup %q in %s: %w", path, tree, err)
		}
		e, ok := lookupEntry(entries, name)
		if !ok {
			return Entry{}, false, nil
		}
		if i == len(names)-1 {
			return e, true, nil
		}
		if e.Mode != ModeTree {
			return Entry{}, false, nil
		}
		cur = e.OID
	}
	panic("unreachable")
}

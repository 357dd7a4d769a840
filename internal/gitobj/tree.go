package gitobj

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Tree entry modes as git writes them.
const (
	ModeTree    uint32 = 0o040000
	ModeFile    uint32 = 0o100644
	ModeExec    uint32 = 0o100755
	ModeSymlink uint32 = 0o120000
	ModeGitlink uint32 = 0o160000
)

// Entry is one entry of a tree object.
type Entry struct {
	Name string
	Mode uint32
	OID  OID
}

// errMalformedTree is wrapped by every ParseTree failure.
var errMalformedTree = errors.New("malformed tree")

// ParseTree parses the content of a tree object. It is strict: anything git
// itself would not write (bad modes, empty or "."/".." names, names with "/",
// entries out of git's order or duplicated, truncated ids) is an error, since
// the rest of the package relies on entries being sorted and unique.
//
// Modes are canonicalised the way git does when reading trees (for example
// the legacy 100664 reads as 100644, and zero-padded modes are accepted), so
// FormatTree of the result is what git's own index would write.
func ParseTree(data []byte) ([]Entry, error) {
	var entries []Entry
	for off := 0; off < len(data); {
		sp := bytes.IndexByte(data[off:], ' ')
		if sp < 0 {
			return nil, fmt.Errorf("gitobj: parse tree at byte %d: %w: no space after mode", off, errMalformedTree)
		}
		mode, err := parseMode(data[off : off+sp])
		if err != nil {
			return nil, fmt.Errorf("gitobj: parse tree at byte %d: %w", off, err)
		}
		nameStart := off + sp + 1
		nul := bytes.IndexByte(data[nameStart:], 0)
		if nul < 0 {
			return nil, fmt.Errorf("gitobj: parse tree at byte %d: %w: unterminated name", off, errMalformedTree)
		}
		name := string(data[nameStart : nameStart+nul])
		if err := checkName(name); err != nil {
			return nil, fmt.Errorf("gitobj: parse tree at byte %d: %w", off, err)
		}
		idStart := nameStart + nul + 1
		if len(data)-idStart < len(OID{}) {
			return nil, fmt.Errorf("gitobj: parse tree entry %q: %w: truncated object id", name, errMalformedTree)
		}
		var id OID
		copy(id[:], data[idStart:])
		e := Entry{Name: name, Mode: mode, OID: id}
		if n := len(entries); n > 0 && compareEntries(entries[n-1], e) >= 0 {
			return nil, fmt.Errorf("gitobj: parse tree entry %q: %w: out of order or duplicate after %q", name, errMalformedTree, entries[n-1].Name)
		}
		// A file and a directory of the same name sort apart ("a" < "a.b" <
		// "a/"), so the adjacent-order check alone would miss that duplicate.
		if mode == ModeTree && hasFile(entries, name) {
			return nil, fmt.Errorf("gitobj: parse tree entry %q: %w: duplicate name", name, errMalformedTree)
		}
		entries = append(entries, e)
		off = idStart + len(id)
	}
	return entries, nil
}

// parseMode parses an octal tree-entry mode and canonicalises it as git's
// canon_mode does; modes of no known object type are rejected.
func parseMode(b []byte) (uint32, error) {
	if len(b) == 0 || len(b) > 7 {
		return 0, fmt.Errorf("%w: bad mode %q", errMalformedTree, b)
	}
	var m uint32
	for _, c := range b {
		if c < '0' || c > '7' {
			return 0, fmt.Errorf("%w: bad mode %q", errMalformedTree, b)
		}
		m = m<<3 | uint32(c-'0')
	}
	switch m & 0o170000 {
	case 0o100000:
		if m&0o100 != 0 {
			return ModeExec, nil
		}
		return ModeFile, nil
	case ModeTree, ModeSymlink, ModeGitlink:
		return m & 0o170000, nil
	}
	return 0, fmt.Errorf("%w: bad mode %q", errMalformedTree, b)
}

// checkName rejects names git never stores in a tree.
func checkName(name string) error {
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00") {
		return fmt.Errorf("%w: bad entry name %q", errMalformedTree, name)
	}
	return nil
}

// hasFile reports whether the git-sorted entries hold a non-tree entry
// named name.
func hasFile(entries []Entry, name string) bool {
	_, ok := findEntry(entries, name, false)
	return ok
}

// findEntry binary-searches the git-sorted entries for name as a tree
// (isTree) or as a non-tree entry.
func findEntry(entries []Entry, name string, isTree bool) (int, bool) {
	mode := ModeFile
	if isTree {
		mode = ModeTree
	}
	key := Entry{Name: name, Mode: mode}
	i, found := slices.BinarySearchFunc(entries, key, compareEntries)
	return i, found && (entries[i].Mode == ModeTree) == isTree
}

// lookupEntry finds name in git-sorted entries whatever its type.
func lookupEntry(entries []Entry, name string) (Entry, bool) {
	if i, ok := findEntry(entries, name, false); ok {
		return entries[i], true
	}
	if i, ok := findEntry(entries, name, true); ok {
		return entries[i], true
	}
	return Entry{}, false
}

// compareEntries is git's tree order: names compare bytewise, except that a
// tree's name compares as if it ended in "/".
func compareEntries(a, b Entry) int {
	n := min(len(a.Name), len(b.Name))
	if c := strings.Compare(a.Name[:n], b.Name[:n]); c != 0 {
		return c
	}
	ca, cb := nextByte(a, n), nextByte(b, n)
	switch {
	case ca < cb:
		return -1
	case ca > cb:
		return 1
	}
	return 0
}

func nextByte(e Entry, n int) byte {
	if n < len(e.Name) {
		return e.Name[n]
	}
	if e.Mode == ModeTree {
		return '/'
	}
	return 0
}

// FormatTree returns the canonical git encoding of entries: sorted in git's
// order, modes written as git writes them ("40000" for trees). The caller's
// slice is not modified. Entries are not validated; names must be valid and
// unique for the result to be a well-formed tree.
func FormatTree(entries []Entry) []byte {
	sorted := slices.Clone(entries)
	slices.SortStableFunc(sorted, compareEntries)
	return formatSorted(sorted)
}

// formatSorted encodes entries already in git's order.
func formatSorted(entries []Entry) []byte {
	size := 0
	for _, e := range entries {
		size += 7 + 1 + len(e.Name) + 1 + len(e.OID)
	}
	b := make([]byte, 0, size)
	for _, e := range entries {
		b = strconv.AppendUint(b, uint64(e.Mode), 8)
		b = append(b, ' ')
		b = append(b, e.Name...)
		b = append(b, 0)
		b = append(b, e.OID[:]...)
	}
	return b
}

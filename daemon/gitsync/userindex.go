package gitsync

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
)

// indexPaths is what the sync needs from the user's index: which paths are
// tracked (git add -A keeps a tracked file even when it is ignored) and
// which are submodules. Read in-process, so knowing whether a changed path
// is tracked costs no git process (git reads the whole index to answer).
type indexPaths struct {
	paths    []string // sorted, as git sorts
	gitlinks []string // sorted
}

var errIndexUnusual = errors.New("the index uses a feature the sync does not read (split or sparse index, skip-worktree entries)")

// readIndexPaths parses an index file (versions 2 to 4). A missing file is
// an empty index. Layouts whose entries are not all in the file, or that
// hide files from the working tree, are errIndexUnusual: the caller then
// scans everything, as git would.
func readIndexPaths(path string, hashLen int) (*indexPaths, error) {
	return walkIndex(path, hashLen, nil)
}

// walkIndex is readIndexPaths that also hands each entry's path, mode
// and object id to each, when set.
func walkIndex(path string, hashLen int, each func(name string, mode uint32, oid []byte)) (*indexPaths, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return &indexPaths{}, nil
	}
	if err != nil {
		return nil, err
	}
	if len(b) < 12+hashLen || string(b[:4]) != "DIRC" {
		return nil, fmt.Errorf("%s: not an index file", path)
	}
	version := binary.BigEndian.Uint32(b[4:8])
	if version < 2 || version > 4 {
		return nil, fmt.Errorf("%s: index version %d", path, version)
	}
	count := int(binary.BigEndian.Uint32(b[8:12]))
	end := len(b) - hashLen
	ix := &indexPaths{paths: make([]string, 0, count)}
	off := 12
	prev := ""
	for i := 0; i < count; i++ {
		fixed := 40 + hashLen + 2
		if off+fixed > end {
			return nil, fmt.Errorf("%s: truncated entry %d", path, i)
		}
		p0 := off
		mode := binary.BigEndian.Uint32(b[off+24 : off+28])
		flags := binary.BigEndian.Uint16(b[off+40+hashLen : off+fixed])
		p := off + fixed
		if flags&0x4000 != 0 {
			if version < 3 || p+2 > end {
				return nil, fmt.Errorf("%s: bad extended entry %d", path, i)
			}
			if binary.BigEndian.Uint16(b[p:p+2])&0x4000 != 0 { // skip-worktree
				return nil, errIndexUnusual
			}
			p += 2
			fixed += 2
		}
		var name string
		if version == 4 {
			strip, n := varint(b[p:end])
			if n == 0 || strip > uint64(len(prev)) {
				return nil, fmt.Errorf("%s: bad path of entry %d", path, i)
			}
			p += n
			nul := bytes.IndexByte(b[p:end], 0)
			if nul < 0 {
				return nil, fmt.Errorf("%s: truncated path of entry %d", path, i)
			}
			name = prev[:len(prev)-int(strip)] + string(b[p:p+nul])
			off = p + nul + 1
		} else {
			nul := bytes.IndexByte(b[p:end], 0)
			if nul < 0 {
				return nil, fmt.Errorf("%s: truncated path of entry %d", path, i)
			}
			name = string(b[p : p+nul])
			off += (fixed + nul + 8) &^ 7
		}
		if each != nil {
			each(name, mode, b[p0+40:p0+40+hashLen])
		}
		switch mode >> 12 {
		case 0o16: // 0160000, a submodule
			ix.gitlinks = append(ix.gitlinks, name)
		case 0o04: // a sparse directory entry
			return nil, errIndexUnusual
		}
		if name != prev || i == 0 {
			ix.paths = append(ix.paths, name)
		}
		prev = name
	}
	for off+8 <= end {
		sig := string(b[off : off+4])
		size := int(binary.BigEndian.Uint32(b[off+4 : off+8]))
		if sig == "link" || sig == "sdir" {
			return nil, errIndexUnusual
		}
		off += 8 + size
	}
	return ix, nil
}

// varint decodes git's offset varint (index v4 path prefixes).
func varint(b []byte) (uint64, int) {
	if len(b) == 0 {
		return 0, 0
	}
	c := b[0]
	val := uint64(c & 127)
	n := 1
	for c&128 != 0 {
		if n >= len(b) || n > 9 {
			return 0, 0
		}
		val++
		c = b[n]
		n++
		val = val<<7 + uint64(c&127)
	}
	return val, n
}

func (ix *indexPaths) tracked(p string) bool {
	i := sort.SearchStrings(ix.paths, p)
	return i < len(ix.paths) && ix.paths[i] == p
}

// inSubmodule tells whether p is a submodule or inside one.
func (ix *indexPaths) inSubmodule(p string) bool {
	for _, g := range ix.gitlinks {
		if p == g || strings.HasPrefix(p, g+"/") {
			return true
		}
	}
	return false
}

// changedPaths lists the paths tracked in one of a and b and not the
// other, submodules included.
func changedPaths(a, b *indexPaths) []string {
	out := symmetricDiff(a.paths, b.paths)
	return append(out, symmetricDiff(a.gitlinks, b.gitlinks)...)
}

func symmetricDiff(a, b []string) []string {
	var out []string
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		switch {
		case j >= len(b) || (i < len(a) && a[i] < b[j]):
			out = append(out, a[i])
			i++
		case i >= len(a) || b[j] < a[i]:
			out = append(out, b[j])
			j++
		default:
			i++
			j++
		}
	}
	return out
}

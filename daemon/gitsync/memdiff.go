package gitsync

import (
	"fmt"
	"path"
	"sort"
	"strings"

	"github.com/sandboxd/sandboxd/internal/gitobj"
)

// The diff of the changed paths, made in-process. Where the sync index is
// staged in-process (memIndex) and HEAD's entry of every path to look at
// is known, the records `git diff --cached --raw HEAD -- <paths>` would
// print are computed here, and the git process is spared
// (docs/performance.md). What they leave out is the patch: only a
// sandbox whose helper serves the native push can do without it
// (PrepareExchange); everything else asks git, as before.
//
// HEAD's entries are learnt from git's own diffs of the same paths (the
// first change of a path asks git, the next ones do not): a record's old
// side is HEAD's file; a path the diff covered and found equal is as the
// sync index holds it, or absent from both. No tree is read and no process
// kept.

// headEntry is HEAD's entry at a path, as far as the sync knows it: a file,
// a symlink or a gitlink (mode), or nothing at all (mode 0). A path where
// HEAD has a directory is never known.
type headEntry = memEntry

const zeroMode = "000000"

// learnHead records what a git diff of spec against head, the sync index
// being mem (nil: unknown), tells of HEAD's entries; full says the diff
// covered the whole tree (a full scan, whose index is not the sync index).
func (st *prepState) learnHead(head string, spec []string, full bool, recs []rawRec, mem memIndex) {
	if st.headFor != head || st.headKnown == nil {
		st.headFor, st.headKnown = head, map[string]headEntry{}
	}
	// Where HEAD has a directory, by the records' old sides.
	dirs := map[string]bool{}
	old := map[string]rawRec{}
	named := map[string]bool{}
	for _, rec := range recs {
		named[rec.src], named[rec.dst] = true, true
		if rec.srcMode == "" || rec.srcMode == zeroMode {
			continue
		}
		old[rec.src] = rec
		for d := path.Dir(rec.src); d != "."; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	var names []string // mem's paths, sorted once hasUnder needs them
	learn := func(p string) {
		if dirs[p] {
			delete(st.headKnown, p)
			return
		}
		if rec, ok := old[p]; ok {
			if e, ok := parseEntry(rec.srcMode, rec.srcSHA); ok {
				st.headKnown[p] = e
			}
			return
		}
		if named[p] {
			// Only a new side: HEAD has no file there, and no directory
			// (its files would be named as deleted).
			st.headKnown[p] = headEntry{}
			return
		}
		if full || mem == nil {
			// Equal to HEAD, but a full scan's index is not the sync index.
			return
		}
		if _, ok := mem[p]; !ok {
			if names == nil {
				names = sortedKeys(mem)
			}
			if hasUnder(names, p) {
				// HEAD may have a directory here whose files the sync
				// index holds unchanged.
				return
			}
		}
		// Covered and equal: HEAD holds what the sync index holds (a path
		// neither holds would have been named if HEAD had it).
		st.headKnown[p] = mem[p]
	}
	// A full scan tells of the paths its records name; a diff limited to
	// spec of those too, and of the rest of spec.
	for p := range named {
		learn(p)
	}
	if !full {
		for _, p := range spec {
			if !named[p] {
				learn(p)
			}
		}
	}
}

// parseEntry reads a raw record's mode and id.
func parseEntry(mode, sha string) (memEntry, bool) {
	var m uint32
	if _, err := fmt.Sscanf(mode, "%o", &m); err != nil {
		return memEntry{}, false
	}
	oid, err := gitobj.ParseOID(sha)
	if err != nil {
		return memEntry{}, false
	}
	return memEntry{mode: m, oid: oid}, true
}

// memDiff is the raw diff of the sync index (st.mem) against head limited
// to spec, without git, when every path of spec has a known HEAD entry. It
// names no renames: a moved file is a deletion and an addition (the native
// push takes both the same way; the patch, when one is made, is git's).
func (st *prepState) memDiff(head string, spec []string) ([]rawRec, bool) {
	if st.mem == nil || st.headFor != head || st.headKnown == nil {
		return nil, false
	}
	// spec is sorted, and what a directory of it holds is in it too (the
	// tracker names what a new directory holds, the records what differs).
	recs := []rawRec{}
	for _, p := range spec {
		h, known := st.headKnown[p]
		if !known || h.mode == gitobj.ModeGitlink {
			return nil, false
		}
		w, staged := st.mem[p]
		switch {
		case h.mode == 0 && staged:
			recs = append(recs, record('A', p, headEntry{}, w))
		case h.mode != 0 && !staged:
			recs = append(recs, record('D', p, h, memEntry{}))
		case h.mode != 0 && h != w:
			status := byte('M')
			if h.mode&0o170000 != w.mode&0o170000 {
				status = 'T'
			}
			recs = append(recs, record(status, p, h, w))
		}
	}
	return recs, true
}

// hasUnder says sorted names holds a path under directory p.
func hasUnder(names []string, p string) bool {
	i := sort.SearchStrings(names, p+"/")
	return i < len(names) && strings.HasPrefix(names[i], p+"/")
}

func record(status byte, p string, from, to memEntry) rawRec {
	rec := rawRec{status: status, src: p, dst: p, srcMode: zeroMode, dstMode: zeroMode,
		srcSHA: gitobj.OID{}.String(), dstSHA: gitobj.OID{}.String()}
	if from.mode != 0 {
		rec.srcMode, rec.srcSHA = fmt.Sprintf("%06o", from.mode), from.oid.String()
	}
	if to.mode != 0 {
		rec.dstMode, rec.dstSHA = fmt.Sprintf("%06o", to.mode), to.oid.String()
	}
	return rec
}

// sameTargets says two diffs of the same trees leave every path the same
// way (renames and their deletion-and-addition are alike).
func sameTargets(a, b []rawRec) bool {
	ta, tb := targets(a), targets(b)
	if len(ta) != len(tb) {
		return false
	}
	for p, v := range ta {
		if tb[p] != v {
			return false
		}
	}
	return true
}

func targets(recs []rawRec) map[string]string {
	t := map[string]string{}
	for _, r := range recs {
		if r.status == 'R' || r.status == 'D' {
			t[r.src] = "gone"
		}
		if r.status != 'D' {
			t[r.dst] = r.dstMode + " " + r.dstSHA
		}
	}
	return t
}

package gitsync

import (
	"bytes"
	"crypto/sha1"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"

	"github.com/sandboxd/sandboxd/internal/gitobj"
	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// The sync index of the changed paths, staged in-process: where git add
// would store each file as it is in the working tree (no attribute or
// setting converts files), hashing a changed file and writing the small
// index here spares the `git update-index` process of every incremental
// Prepare. Anything it is not sure of goes back to git.

// memIndex mirrors the sync index: path to its entry.
type memIndex map[string]memEntry

// memEntry is a path's entry: no stat data, which git diff --cached does
// not read (git update-index --index-info writes none either).
type memEntry struct {
	mode uint32
	oid  gitobj.OID
}

// maxInProcessFile bounds a file hashed in-process: a larger one is left to
// git, which streams it.
const maxInProcessFile = 8 << 20

// errToGit says in-process staging does not vouch for a path: git stages.
var errToGit = errors.New("staged by git")

// memFromRecs is the sync index a full scan's records make (resetSmall).
func memFromRecs(recs []rawRec) (memIndex, bool) {
	m := memIndex{}
	for _, rec := range recs {
		if rec.status == 'D' || rec.dstMode == "000000" || rec.dstMode == "" {
			continue
		}
		var mode uint32
		if _, err := fmt.Sscanf(rec.dstMode, "%o", &mode); err != nil {
			return nil, false
		}
		oid, err := gitobj.ParseOID(rec.dstSHA)
		if err != nil {
			return nil, false
		}
		m[rec.dst] = memEntry{mode: mode, oid: oid}
	}
	return m, true
}

// blob is a staged file's content, whose object is yet to be written.
type blob struct {
	oid  gitobj.OID
	data []byte
}

// stage does what `git update-index --add --remove --replace` does with
// feed (paths relative to root) and `--force-remove` with remove, and
// returns the new content of the paths fed (writeBlobs stores it). It
// changes m only when it returns nil.
func (m memIndex) stage(root string, feed, remove []string) (map[string]blob, error) {
	type staged struct {
		path string
		e    memEntry
		ok   bool // false: removed
	}
	var out []staged
	blobs := map[string]blob{}
	for _, p := range feed {
		if !helperproto.ValidPath(p) {
			return nil, errToGit
		}
		abs := filepath.Join(root, filepath.FromSlash(p))
		fi, err := os.Lstat(abs)
		switch {
		case errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR):
			out = append(out, staged{path: p})
			continue
		case err != nil:
			return nil, fmt.Errorf("look at %s: %w", p, err)
		}
		var data []byte
		mode, ok := gitobj.ModeOf(fi)
		switch {
		case !ok:
			return nil, errToGit
		case mode == gitobj.ModeSymlink:
			var t string
			t, err = os.Readlink(abs)
			data = []byte(t)
		case fi.Size() > maxInProcessFile:
			return nil, errToGit
		default:
			data, err = os.ReadFile(abs)
		}
		if err != nil {
			// Changed under us (removed, replaced by a directory): git
			// decides.
			return nil, errToGit
		}
		if data == nil {
			data = []byte{}
		}
		oid := gitobj.HashObject("blob", data)
		blobs[p] = blob{oid: oid, data: data}
		out = append(out, staged{path: p, e: memEntry{mode: mode, oid: oid}, ok: true})
	}
	// After the feed, as git runs the two.
	for _, p := range remove {
		out = append(out, staged{path: p})
	}
	for _, s := range out {
		if !s.ok {
			delete(m, s.path)
			continue
		}
		// --replace: a file here ends the entries below it and the ones
		// of its parent directories.
		for q := range m {
			if strings.HasPrefix(q, s.path+"/") || strings.HasPrefix(s.path, q+"/") {
				delete(m, q)
			}
		}
		m[s.path] = s.e
	}
	return blobs, nil
}

// writeBlobs stores blobs in objects.
func writeBlobs(objects *gitobj.Store, blobs map[string]blob) error {
	for p, b := range blobs {
		if _, err := objects.Write("blob", b.data); err != nil {
			return fmt.Errorf("store %s: %w", p, err)
		}
	}
	return nil
}

// write writes m as an index file (version 2) at path, atomically.
func (m memIndex) write(path string) error {
	names := make([]string, 0, len(m))
	for p := range m {
		names = append(names, p)
	}
	sort.Strings(names) // git's order: bytewise, stage 0 only
	var b bytes.Buffer
	b.WriteString("DIRC")
	_ = binary.Write(&b, binary.BigEndian, [2]uint32{2, uint32(len(names))})
	for _, p := range names {
		e := m[p]
		start := b.Len()
		// ctime, mtime, dev, ino, mode, uid, gid, size: only the mode.
		_ = binary.Write(&b, binary.BigEndian, [10]uint32{6: e.mode})
		b.Write(e.oid[:])
		_ = binary.Write(&b, binary.BigEndian, uint16(min(len(p), 0xfff)))
		b.WriteString(p)
		// NUL-padded to a multiple of 8, at least one NUL.
		b.Write(make([]byte, 8-(b.Len()-start)%8))
	}
	sum := sha1.Sum(b.Bytes())
	b.Write(sum[:])
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b.Bytes(), 0o600); err != nil {
		return fmt.Errorf("write the sync index: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("write the sync index: %w", err)
	}
	return nil
}

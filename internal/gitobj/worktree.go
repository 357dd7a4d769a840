package gitobj

import (
	"crypto/sha1"
	"fmt"
	"io"
	"io/fs"
	"os"
)

// What git add stores for a path of the working tree when nothing converts
// files (no line-end or filter attributes, core.fileMode and core.symlinks
// true): the sandbox helper's native sync.

// ModeOf is the mode git stores for fi: a symbolic link, or a file whose
// owner's execute bit makes it executable. ok is false for anything else
// (a directory, a device).
func ModeOf(fi fs.FileInfo) (mode uint32, ok bool) {
	switch {
	case fi.Mode()&fs.ModeSymlink != 0:
		return ModeSymlink, true
	case fi.Mode().IsRegular():
		if fi.Mode()&0o100 != 0 {
			return ModeExec, true
		}
		return ModeFile, true
	}
	return 0, false
}

// HashFile is the blob id of the file at path, of size bytes, read as a
// stream; a file whose length is not size changed while it was read.
func HashFile(path string, size int64) (OID, error) {
	f, err := os.Open(path)
	if err != nil {
		return OID{}, err
	}
	defer f.Close()
	h := sha1.New()
	h.Write(objectHeader("blob", int(size)))
	n, err := io.Copy(h, f)
	if err != nil {
		return OID{}, err
	}
	if n != size {
		return OID{}, fmt.Errorf("%s changed while it was read", path)
	}
	var o OID
	h.Sum(o[:0])
	return o, nil
}

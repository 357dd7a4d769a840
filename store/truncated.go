package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"io/fs"
	"os"
)

// bbolt's on-disk format (go.etcd.io/bbolt, format version 2): every page
// starts with a 16-byte header; the two meta pages (pages 0 and 1) then hold
// magic, version, page size, flags, the root bucket (root page, sequence),
// the freelist page, the high-water page id, the transaction id and an
// FNV-64a checksum of the fields before it.
const (
	boltMagic      = 0xED0CDAED
	boltVersion    = 2
	boltPageHeader = 16
	boltMetaSize   = 64 // through the checksum
	boltSumOffset  = 56 // the checksum covers the 56 bytes before it
	boltNoFreelist = ^uint64(0)
)

type boltMeta struct {
	pageSize                 uint32
	root, freelist, pgid, tx uint64
}

// parseBoltMeta decodes the meta page at the start of b, or reports that it
// is not a valid one (bad magic, version or checksum).
func parseBoltMeta(b []byte) (boltMeta, bool) {
	if len(b) < boltPageHeader+boltMetaSize {
		return boltMeta{}, false
	}
	m := b[boltPageHeader : boltPageHeader+boltMetaSize]
	le := binary.LittleEndian
	if le.Uint32(m[0:]) != boltMagic || le.Uint32(m[4:]) != boltVersion {
		return boltMeta{}, false
	}
	h := fnv.New64a()
	_, _ = h.Write(m[:boltSumOffset])
	if h.Sum64() != le.Uint64(m[boltSumOffset:]) {
		return boltMeta{}, false
	}
	return boltMeta{pageSize: le.Uint32(m[8:]), root: le.Uint64(m[16:]), freelist: le.Uint64(m[32:]), pgid: le.Uint64(m[40:]), tx: le.Uint64(m[48:])}, true
}

// checkNotTruncated reads the meta pages of the database file at path
// itself and fails with a CorruptError when the file is shorter than the
// pages they describe. bbolt maps the file into memory and reads those
// pages without checking the file's size: on a truncated file that is a
// SIGBUS, which kills the process with a stack trace instead of an error
// (and a crash loop under Restart=on-failure). The file is only read.
func checkNotTruncated(path string) error {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("open store %s: %w", path, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("open store %s: %w", path, err)
	}
	size := st.Size()
	if size == 0 {
		return nil // bbolt initializes an empty file
	}
	corrupt := func(format string, a ...any) error {
		return &CorruptError{Path: path, Err: fmt.Errorf(format, a...)}
	}
	head := make([]byte, boltPageHeader+boltMetaSize)
	var metas []boltMeta
	if _, err := f.ReadAt(head, 0); err == nil {
		if m, ok := parseBoltMeta(head); ok {
			metas = append(metas, m)
		}
	}
	// The second meta page is one page in; the page size comes from the
	// first meta page, or (when it is damaged) is one bbolt may have used.
	sizes := []int64{4096}
	if len(metas) == 1 {
		sizes = []int64{int64(metas[0].pageSize)}
	} else {
		for ps := int64(1024); ps <= 1<<24; ps <<= 1 {
			sizes = append(sizes, ps)
		}
	}
	for _, ps := range sizes {
		if _, err := f.ReadAt(head, ps); err != nil && !errors.Is(err, io.EOF) {
			continue
		}
		if m, ok := parseBoltMeta(head); ok && int64(m.pageSize) == ps {
			metas = append(metas, m)
			break
		}
	}
	if len(metas) == 0 {
		return nil // not a bbolt file at all: bbolt says so itself
	}
	// bbolt uses the valid meta page with the highest transaction id.
	m := metas[0]
	for _, o := range metas[1:] {
		if o.tx > m.tx {
			m = o
		}
	}
	ps := int64(m.pageSize)
	if ps < 1024 || ps > 1<<24 || ps&(ps-1) != 0 {
		return corrupt("its meta page gives an impossible page size %d", m.pageSize)
	}
	if m.pgid < 2 || m.root >= m.pgid || (m.freelist != boltNoFreelist && m.freelist >= m.pgid) {
		return corrupt("its meta page points outside its own pages (root %d, freelist %d, %d pages)", m.root, m.freelist, m.pgid)
	}
	if m.pgid > uint64(size/ps) {
		return corrupt("the file is %d bytes, shorter than the %d pages of %d bytes its metadata describes: it was truncated", size, m.pgid, ps)
	}
	return nil
}

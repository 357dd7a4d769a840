// Package gitobj reads, writes, edits and compares git objects of a SHA-1
// repository in-process, so that building and diffing trees costs time
// proportional to what changed rather than to the size of the checkout, and
// never touches the repository's index.
package gitobj

import (
	"crypto/sha1"
	"encoding/hex"
	"fmt"
	"strconv"
)

// OID is a SHA-1 git object id.
type OID [20]byte

// ParseOID parses 40 hexadecimal characters (either case).
func ParseOID(s string) (OID, error) {
	var o OID
	if len(s) != 2*len(o) {
		return OID{}, fmt.Errorf("gitobj: parse object id %q: want %d hex characters, got %d", s, 2*len(o), len(s))
	}
	if _, err := hex.Decode(o[:], []byte(s)); err != nil {
		return OID{}, fmt.Errorf("gitobj: parse object id %q: %w", s, err)
	}
	return o, nil
}

// String returns the id as 40 lowercase hexadecimal characters.
func (o OID) String() string { return hex.EncodeToString(o[:]) }

// IsZero reports whether o is the all-zero id, which this package uses to
// mean "no tree" (the empty tree) and git uses to mean "no object".
func (o OID) IsZero() bool { return o == OID{} }

// emptyTreeOID is the id of the tree with no entries, which git knows without
// it being stored but which must be written before other tools may rely on it.
var emptyTreeOID = OID{0x4b, 0x82, 0x5d, 0xc6, 0x42, 0xcb, 0x6e, 0xb9, 0xa0, 0x60,
	0xe5, 0x4b, 0xf8, 0xd6, 0x92, 0x88, 0xfb, 0xee, 0x49, 0x04}

// HashObject is git's object id of data as an object of kind ("blob", "tree",
// "commit").
func HashObject(kind string, data []byte) OID {
	h := sha1.New()
	h.Write(objectHeader(kind, len(data)))
	h.Write(data)
	var o OID
	h.Sum(o[:0])
	return o
}

// objectHeader is the "<kind> <size>\x00" prefix that git hashes and stores
// in front of an object's content.
func objectHeader(kind string, size int) []byte {
	b := make([]byte, 0, len(kind)+22)
	b = append(b, kind...)
	b = append(b, ' ')
	b = strconv.AppendInt(b, int64(size), 10)
	return append(b, 0)
}

package gitsync

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"unicode/utf8"

	"github.com/sandboxd/sandboxd/internal/gitobj"
	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// nativeEntries are the paths the patch changes as the sandbox helper's
// native push takes them (see sandboxhelper): each changed path's mode and
// blob, with the blob's content, read from the working tree and checked
// against the id git staged. ok is false when the patch holds what the
// native push does not take (a submodule, an unmerged path, LFS files left
// out, a file changed since it was staged, contents over max bytes): the
// sandbox then applies the patch.
func nativeEntries(root string, recs []rawRec, lfs []string, max int) (entries []helperproto.PushEntry, ok bool) {
	if len(lfs) > 0 {
		return nil, false
	}
	entries = []helperproto.PushEntry{}
	size := 0
	for _, r := range recs {
		// JSON would carry other bytes as U+FFFD.
		if !utf8.ValidString(r.src) || !utf8.ValidString(r.dst) {
			return nil, false
		}
		switch r.status {
		case 'D':
			entries = append(entries, helperproto.PushEntry{Path: r.dst})
			continue
		case 'R':
			entries = append(entries, helperproto.PushEntry{Path: r.src})
		case 'A', 'M', 'T', 'C':
		default:
			return nil, false
		}
		mode, err := strconv.ParseUint(r.dstMode, 8, 32)
		if err != nil {
			return nil, false
		}
		var data []byte
		abs := filepath.Join(root, filepath.FromSlash(r.dst))
		// A large file is not read only to find it is over max.
		if fi, err := os.Lstat(abs); err != nil || size+int(fi.Size()) > max {
			return nil, false
		}
		switch uint32(mode) {
		case gitobj.ModeFile, gitobj.ModeExec:
			data, err = os.ReadFile(abs)
		case gitobj.ModeSymlink:
			var t string
			t, err = os.Readlink(abs)
			data = []byte(t)
		default:
			return nil, false
		}
		size += len(data) + len(r.dst)
		if err != nil || size > max || gitobj.HashObject("blob", data).String() != r.dstSHA {
			return nil, false
		}
		if data == nil {
			data = []byte{}
		}
		entries = append(entries, helperproto.PushEntry{Path: r.dst, Mode: uint32(mode), OID: r.dstSHA, Data: data})
	}
	return entries, true
}

// nativeBundle is entries as the exchange's request carries them to the
// helper: their JSON (file contents are base64 in it).
func nativeBundle(entries []helperproto.PushEntry) (string, bool) {
	raw, err := json.Marshal(entries)
	if err != nil {
		return "", false
	}
	return string(raw), true
}

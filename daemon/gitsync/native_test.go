package gitsync

import (
	"path/filepath"
	"testing"

	"github.com/sandboxd/sandboxd/internal/gitobj"
)

// The entries of the helper's native push say what the patch says, with
// the staged content; anything the native push does not take, or content
// that is no longer what git staged, leaves the patch alone to travel.
func TestNativeEntries(t *testing.T) {
	root := t.TempDir()
	writeFile(t, filepath.Join(root, "a.txt"), "a\n")
	writeFile(t, filepath.Join(root, "new/b.txt"), "b\n")
	id := func(s string) string { return gitobj.HashObject("blob", []byte(s)).String() }
	recs := []rawRec{
		{status: 'M', dstMode: "100644", dstSHA: id("a\n"), src: "a.txt", dst: "a.txt"},
		{status: 'R', dstMode: "100755", dstSHA: id("b\n"), src: "old/b.txt", dst: "new/b.txt"},
		{status: 'D', dstMode: "000000", dstSHA: "0000000000000000000000000000000000000000", src: "gone.txt", dst: "gone.txt"},
	}
	entries, ok := nativeEntries(root, recs, nil, 1<<10)
	if !ok || len(entries) != 4 {
		t.Fatalf("entries %+v, ok %v", entries, ok)
	}
	want := []struct {
		path string
		mode uint32
		data string
	}{{"a.txt", gitobj.ModeFile, "a\n"}, {"old/b.txt", 0, ""}, {"new/b.txt", gitobj.ModeExec, "b\n"}, {"gone.txt", 0, ""}}
	for i, w := range want {
		if e := entries[i]; e.Path != w.path || e.Mode != w.mode || string(e.Data) != w.data {
			t.Fatalf("entry %d is %+v, want %+v", i, e, w)
		}
	}
	for name, c := range map[string]struct {
		recs []rawRec
		lfs  []string
		max  int
	}{
		"changed since staged": {recs: []rawRec{{status: 'M', dstMode: "100644", dstSHA: id("other\n"), dst: "a.txt", src: "a.txt"}}, max: 1 << 10},
		"submodule":            {recs: []rawRec{{status: 'A', dstMode: "160000", dstSHA: id("a\n"), dst: "a.txt", src: "a.txt"}}, max: 1 << 10},
		"unmerged":             {recs: []rawRec{{status: 'U', dstMode: "100644", dstSHA: id("a\n"), dst: "a.txt", src: "a.txt"}}, max: 1 << 10},
		"LFS left out":         {recs: recs[:1], lfs: []string{"big.bin"}, max: 1 << 10},
		"over the limit":       {recs: recs[:1], max: 4},
		"not UTF-8":            {recs: []rawRec{{status: 'D', dstMode: "000000", dst: "\xff.txt", src: "\xff.txt"}}, max: 1 << 10},
	} {
		if e, ok := nativeEntries(root, c.recs, c.lfs, c.max); ok {
			t.Errorf("%s: native entries %+v", name, e)
		}
	}
}

package gitobj

import (
	"bytes"
	"compress/zlib"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

func TestParseOID(t *testing.T) {
	const hex = "4B825DC642CB6EB9A060E54BF8D69288FBEE4904"
	o, err := ParseOID(hex)
	if err != nil {
		t.Fatal(err)
	}
	if o != emptyTreeOID || o.String() != strings.ToLower(hex) {
		t.Fatalf("ParseOID(%s) = %s", hex, o)
	}
	if o.IsZero() || !(OID{}).IsZero() {
		t.Fatal("IsZero wrong")
	}
	for _, bad := range []string{"", "4b825dc", hex + "0", strings.Replace(hex, "4", "g", 1), " " + hex[1:]} {
		if _, err := ParseOID(bad); err == nil {
			t.Errorf("ParseOID(%q) succeeded", bad)
		}
	}
}

func TestHashObjectMatchesGit(t *testing.T) {
	r := newTestRepo(t)
	blobs := []string{"", "hello\n", "no newline", "bin\x00ary\xff\x00", strings.Repeat("x", 100000)}
	for _, b := range blobs {
		want := r.oid(r.git(nil, b, "hash-object", "--stdin"))
		if got := HashObject("blob", []byte(b)); got != want {
			t.Errorf("blob %.20q: got %s, git says %s", b, got, want)
		}
	}
	commit := "tree " + emptyTreeOID.String() + "\nauthor A <a@b> 1 +0000\ncommitter A <a@b> 1 +0000\n\nmsg\n"
	if got, want := HashObject("commit", []byte(commit)), r.oid(r.git(nil, commit, "hash-object", "-t", "commit", "--stdin")); got != want {
		t.Errorf("commit: got %s, git says %s", got, want)
	}
	if got := HashObject("tree", nil); got != emptyTreeOID {
		t.Errorf("empty tree: got %s", got)
	}
	tree := FormatTree([]Entry{{Name: "f", Mode: ModeFile, OID: HashObject("blob", nil)}})
	if got, want := HashObject("tree", tree), r.oid(r.git(nil, string(tree), "hash-object", "-t", "tree", "--stdin")); got != want {
		t.Errorf("tree: got %s, git says %s", got, want)
	}
}

// mktree is the reference for FormatTree.
func (r *testRepo) mktree(entries []Entry) (OID, []byte) {
	var in strings.Builder
	for _, e := range entries {
		kind := "blob"
		switch e.Mode {
		case ModeTree:
			kind = "tree"
		case ModeGitlink:
			kind = "commit"
		}
		fmt.Fprintf(&in, "%06o %s %s\t%s\x00", e.Mode, kind, e.OID, e.Name)
	}
	oid := r.oid(r.git(nil, in.String(), "mktree", "-z", "--missing"))
	return oid, []byte(r.git(nil, "", "cat-file", "tree", oid.String()))
}

func fakeOID(i int) OID { return HashObject("blob", []byte(fmt.Sprint(i))) }

func rawOID(o OID) string { return string(o[:]) }

func TestFormatTreeMatchesMktree(t *testing.T) {
	r := newTestRepo(t)
	sets := [][]Entry{
		{ // tree "a" sorts after "a.b", "a-b" but before "a0"
			{Name: "a", Mode: ModeTree}, {Name: "a.b", Mode: ModeFile}, {Name: "a-b", Mode: ModeFile},
			{Name: "a0", Mode: ModeFile}, {Name: "a!", Mode: ModeExec}, {Name: "a.c", Mode: ModeTree},
			{Name: "ab", Mode: ModeSymlink}, {Name: "ä", Mode: ModeFile}, {Name: "日本語", Mode: ModeTree},
			{Name: "Z", Mode: ModeTree}, {Name: "z", Mode: ModeGitlink}, {Name: "with space", Mode: ModeFile},
			{Name: "tab\there", Mode: ModeFile}, {Name: "new\nline", Mode: ModeFile}, {Name: "a\x7f", Mode: ModeFile},
		},
		{ // file "a" sorts first; trees whose names extend it sort around "/"
			{Name: "a", Mode: ModeFile}, {Name: "a.b", Mode: ModeTree}, {Name: "a-b", Mode: ModeExec},
			{Name: "a0", Mode: ModeSymlink}, {Name: "a+", Mode: ModeTree}, {Name: "sub", Mode: ModeGitlink},
			{Name: "b", Mode: ModeTree}, {Name: "b.txt", Mode: ModeFile}, {Name: "b0", Mode: ModeFile},
			{Name: "b-", Mode: ModeTree}, {Name: "b.", Mode: ModeTree},
		},
		{},
	}
	for i, set := range sets {
		for j := range set {
			set[j].OID = fakeOID(i*100 + j)
		}
		rand.Shuffle(len(set), func(a, b int) { set[a], set[b] = set[b], set[a] })
		before := slices.Clone(set)
		got := FormatTree(set)
		if !reflect.DeepEqual(set, before) {
			t.Errorf("set %d: FormatTree modified its argument", i)
		}
		wantOID, want := r.mktree(set)
		if !bytes.Equal(got, want) {
			t.Errorf("set %d: FormatTree differs from git mktree\n got %q\nwant %q", i, got, want)
		}
		if HashObject("tree", got) != wantOID {
			t.Errorf("set %d: hash differs from git mktree", i)
		}
		parsed, err := ParseTree(want)
		if err != nil {
			t.Fatalf("set %d: ParseTree(git's tree): %v", i, err)
		}
		sorted := slices.Clone(set)
		slices.SortFunc(sorted, compareEntries)
		if len(sorted) == 0 {
			sorted = nil
		}
		if !reflect.DeepEqual(parsed, sorted) {
			t.Errorf("set %d: ParseTree = %v, want %v", i, parsed, sorted)
		}
	}
}

func TestParseTreeMalformed(t *testing.T) {
	id := rawOID(fakeOID(1))
	ok := "100644 a\x00" + id
	if _, err := ParseTree([]byte(ok)); err != nil {
		t.Fatalf("valid tree rejected: %v", err)
	}
	cases := map[string]string{
		"truncated id":       "100644 a\x00" + id[:19],
		"no name terminator": "100644 a",
		"no space":           "100644",
		"empty mode":         " a\x00" + id,
		"non-octal mode":     "100648 a\x00" + id,
		"mode too long":      "10000644 a\x00" + id,
		"unknown type":       "070000 a\x00" + id,
		"zero mode":          "0 a\x00" + id,
		"empty name":         "100644 \x00" + id,
		"dot":                "100644 .\x00" + id,
		"dotdot":             "40000 ..\x00" + id,
		"slash":              "100644 a/b\x00" + id,
		"unsorted":           "100644 b\x00" + id + "100644 a\x00" + id,
		"duplicate":          ok + ok,
		"tree sorts late":    "40000 a\x00" + id + "100644 a.b\x00" + id,
		"file/dir duplicate": "100644 a\x00" + id + "100644 a.b\x00" + id + "40000 a\x00" + id,
		"trailing garbage":   ok + "1",
	}
	for name, data := range cases {
		if e, err := ParseTree([]byte(data)); err == nil {
			t.Errorf("%s: ParseTree(%q) = %v, want error", name, data, e)
		}
	}
	// Git canonicalises legacy modes when reading; so do we.
	e, err := ParseTree([]byte("100664 a\x00" + id + "040000 b\x00" + id + "100775 c\x00" + id))
	if err != nil || e[0].Mode != ModeFile || e[1].Mode != ModeTree || e[2].Mode != ModeExec {
		t.Errorf("legacy modes: %v, %v", e, err)
	}
}

func FuzzParseTree(f *testing.F) {
	id := rawOID(fakeOID(1))
	f.Add([]byte{})
	f.Add([]byte("100644 a\x00" + id))
	f.Add([]byte("100644 a\x00" + id + "100755 a.b\x00" + id + "40000 a\x00" + id + "120000 a0\x00" + id + "160000 z\x00" + id))
	f.Add([]byte("040000 b\x00" + id + "100664 c\x00" + id))
	f.Add([]byte("100644 a\x00" + id[:5]))
	f.Add([]byte("40000 a\x00" + id + "100644 a.b\x00" + id))
	f.Fuzz(func(t *testing.T, data []byte) {
		e1, err := ParseTree(data)
		if err != nil {
			return
		}
		b1 := FormatTree(e1)
		e2, err := ParseTree(b1)
		if err != nil {
			t.Fatalf("ParseTree(FormatTree(%v)): %v", e1, err)
		}
		if !reflect.DeepEqual(e1, e2) && (len(e1) != 0 || len(e2) != 0) {
			t.Fatalf("round trip: %v != %v", e1, e2)
		}
		if b2 := FormatTree(e2); !bytes.Equal(b1, b2) {
			t.Fatalf("FormatTree not stable: %q != %q", b1, b2)
		}
	})
}

func TestWriteReadFsck(t *testing.T) {
	r := newTestRepo(t)
	s := r.open()
	content := []byte("hello\x00world\n")
	b, err := s.Write("blob", content)
	if err != nil {
		t.Fatal(err)
	}
	if got := r.git(nil, "", "cat-file", "-p", b.String()); got != string(content) {
		t.Fatalf("cat-file -p blob = %q", got)
	}
	tree, err := s.Write("tree", FormatTree([]Entry{{Name: "f", Mode: ModeFile, OID: b}, {Name: "x", Mode: ModeExec, OID: b}}))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := r.git(nil, "", "cat-file", "-p", tree.String()), fmt.Sprintf("100644 blob %s\tf\n100755 blob %s\tx\n", b, b); got != want {
		t.Fatalf("cat-file -p tree = %q, want %q", got, want)
	}
	commit := "tree " + tree.String() + "\nauthor A <a@b.c> 1700000000 +0000\ncommitter A <a@b.c> 1700000000 +0000\n\nmsg\n"
	c, err := s.Write("commit", []byte(commit))
	if err != nil {
		t.Fatal(err)
	}
	if got := r.git(nil, "", "cat-file", "-p", c.String()); got != commit {
		t.Fatalf("cat-file -p commit = %q", got)
	}
	r.git(nil, "", "update-ref", "refs/heads/main", c.String())

	// Loose, read-only, and not rewritten the second time.
	path := filepath.Join(r.gitDir, "objects", b.String()[:2], b.String()[2:])
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o444 {
		t.Errorf("object mode %v, want 0444", fi.Mode().Perm())
	}
	old := time.Unix(1000, 0)
	if err := os.Chtimes(path, old, old); err != nil {
		t.Fatal(err)
	}
	if b2, err := s.Write("blob", content); err != nil || b2 != b {
		t.Fatalf("rewrite: %s, %v", b2, err)
	}
	if fi, _ := os.Stat(path); !fi.ModTime().Equal(old) {
		t.Error("existing loose object was rewritten")
	}
	if tmps, _ := filepath.Glob(filepath.Join(r.gitDir, "objects", "tmp_obj_*")); len(tmps) > 0 {
		t.Errorf("temporary files left: %v", tmps)
	}
	// Round trip through our own reader, for a freshly written object.
	if kind, data, err := s.Read(ctxT(t), c); err != nil || kind != "commit" || string(data) != commit {
		t.Fatalf("Read commit = %q %q %v", kind, data, err)
	}
	if _, err := s.Write("tree", []byte("garbage")); err == nil {
		t.Error("Write accepted a malformed tree")
	}
	if _, err := s.Write("bogus", nil); err == nil {
		t.Error("Write accepted an unknown kind")
	}
	r.fsck()
}

func TestOpenStoreErrors(t *testing.T) {
	if _, err := OpenStore(t.TempDir()); err == nil {
		t.Error("OpenStore of a directory without objects succeeded")
	}
}

func TestReadPackedAndMissing(t *testing.T) {
	r := newTestRepo(t)
	// Several similar large versions of a file, so gc stores deltas.
	var lines []string
	for i := range 3000 {
		lines = append(lines, fmt.Sprintf("line %d of a reasonably long file", i))
	}
	var blobs []OID
	var contents []string
	var trees []OID
	parent := ""
	for v := range 6 {
		lines[v*100] = fmt.Sprintf("changed in version %d", v)
		content := strings.Join(lines, "\n")
		b := r.blob(content)
		blobs, contents = append(blobs, b), append(contents, content)
		tree := r.oid(r.git(nil, fmt.Sprintf("100644 blob %s\tfile.txt\n", b), "mktree"))
		trees = append(trees, tree)
		args := []string{"commit-tree", tree.String(), "-m", fmt.Sprint(v)}
		if parent != "" {
			args = append(args, "-p", parent)
		}
		parent = strings.TrimSpace(r.git(nil, "", args...))
	}
	r.git(nil, "", "update-ref", "refs/heads/main", parent)
	r.git(nil, "", "gc", "-q", "--aggressive", "--prune=now")
	if out := r.git(nil, "", "count-objects", "-v"); !strings.Contains(out, "count: 0\n") {
		t.Fatalf("objects still loose after gc:\n%s", out)
	}
	packs, _ := filepath.Glob(filepath.Join(r.gitDir, "objects", "pack", "*.idx"))
	if len(packs) == 0 || !strings.Contains(r.git(nil, "", "verify-pack", "-v", packs[0]), "chain length") {
		t.Fatal("gc produced no deltas")
	}
	s := r.open()
	for i, b := range blobs {
		kind, data, err := s.Read(ctxT(t), b)
		if err != nil || kind != "blob" || string(data) != contents[i] {
			t.Fatalf("Read packed blob %d: kind %q, %d bytes, %v", i, kind, len(data), err)
		}
		e, err := s.ReadTree(ctxT(t), trees[i])
		if err != nil || len(e) != 1 || e[0].OID != b || e[0].Name != "file.txt" {
			t.Fatalf("ReadTree packed tree %d: %v %v", i, e, err)
		}
	}
	missing := fakeOID(424242)
	if _, _, err := s.Read(ctxT(t), missing); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Read missing object: %v, want ErrNotFound", err)
	}
	if _, err := s.ReadTree(ctxT(t), missing); !errors.Is(err, ErrNotFound) {
		t.Fatalf("ReadTree missing object: %v, want ErrNotFound", err)
	}
	// The child survives a miss.
	if _, _, err := s.Read(ctxT(t), blobs[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := s.ReadTree(ctxT(t), blobs[0]); err == nil {
		t.Fatal("ReadTree of a blob succeeded")
	}
}

func TestChildReplacedAfterKill(t *testing.T) {
	r := newTestRepo(t)
	b := r.blob("content")
	s := r.open()
	read := func() {
		t.Helper()
		if _, data, err := s.Read(ctxT(t), b); err != nil || string(data) != "content" {
			t.Fatalf("Read: %q, %v", data, err)
		}
	}
	child := func() *catFile {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.child
	}
	read()
	for i := range 5 {
		c := child()
		if err := c.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			<-c.done // the death is noticed before the next request...
		} // ...or not, and the request fails and is retried.
		read()
		if child() == c {
			t.Fatal("dead child not replaced")
		}
	}
	// A child whose pipe broke while it still runs is replaced too.
	c := child()
	c.stdout.Close()
	read()
	select {
	case <-c.done:
	case <-time.After(5 * time.Second):
		t.Fatal("broken child not reaped")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Read(ctxT(t), b); err == nil {
		t.Fatal("Read after Close succeeded")
	}
}

func TestReadHonoursContext(t *testing.T) {
	r := newTestRepo(t)
	b := r.blob("content")
	s := r.open()

	// A child that never answers: the read must give up when ctx ends.
	s.command = []string{"sh", "-c", "exec sleep 3600"}
	ctx, cancel := context.WithTimeout(ctxT(t), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, _, err := s.Read(ctx, b)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Read with a stuck child: %v", err)
	}
	if time.Since(start) > 5*time.Second {
		t.Fatal("Read did not return promptly")
	}
	s.command = []string{"git", "-c", "safe.directory=*", "cat-file", "--batch"}
	if _, _, err := s.Read(ctxT(t), b); err != nil {
		t.Fatalf("Read after a killed child: %v", err)
	}

	// Waiting for another reader is bounded by ctx too.
	s.sem <- struct{}{}
	ctx2, cancel2 := context.WithTimeout(ctxT(t), 100*time.Millisecond)
	defer cancel2()
	if _, _, err := s.Read(ctx2, b); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Read while busy: %v", err)
	}
	<-s.sem
}

func TestConcurrentReads(t *testing.T) {
	r := newTestRepo(t)
	s := r.open()
	var blobs []OID
	var changes []Change
	for i := range 40 {
		b := r.blob(fmt.Sprintf("blob %d\n", i))
		blobs = append(blobs, b)
		changes = append(changes, Change{Path: fmt.Sprintf("d%d/f%d", i%5, i), Mode: ModeFile, OID: b})
	}
	root, err := s.EditTree(ctxT(t), OID{}, changes)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 50 {
				k := (g*50 + i) % len(blobs)
				_, data, err := s.Read(ctxT(t), blobs[k])
				if err == nil && string(data) != fmt.Sprintf("blob %d\n", k) {
					err = fmt.Errorf("blob %d: got %q", k, data)
				}
				if err == nil {
					var e Entry
					var ok bool
					e, ok, err = s.Lookup(ctxT(t), root, fmt.Sprintf("d%d/f%d", k%5, k))
					if err == nil && (!ok || e.OID != blobs[k]) {
						err = fmt.Errorf("lookup %d: %v %v", k, e, ok)
					}
				}
				if err == nil {
					_, err = s.Write("blob", []byte(fmt.Sprintf("new %d %d", g, i)))
				}
				if err == nil {
					_, err = s.DiffTrees(ctxT(t), OID{}, root)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestTreeCacheBounded(t *testing.T) {
	r := newTestRepo(t)
	s := r.open()
	s.cacheMax = 3
	var changes []Change
	for i := range 10 {
		changes = append(changes, Change{Path: fmt.Sprintf("d%d/f", i), Mode: ModeFile, OID: r.blob(fmt.Sprint(i))})
	}
	root, err := s.EditTree(ctxT(t), OID{}, changes)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.DiffTrees(ctxT(t), OID{}, root); err != nil {
		t.Fatal(err)
	}
	if len(s.cacheMap) > 3 || s.cacheList.Len() != len(s.cacheMap) {
		t.Fatalf("cache holds %d/%d trees, limit 3", len(s.cacheMap), s.cacheList.Len())
	}
	// Callers may scribble on ReadTree results without corrupting the cache.
	e, _ := s.ReadTree(ctxT(t), root)
	e[0].Name = "scribbled"
	if e2, _ := s.ReadTree(ctxT(t), root); e2[0].Name != "d0" {
		t.Fatalf("cache corrupted: %v", e2)
	}
}

// TestStoreIgnoresInheritedGitEnv checks that the reader is pinned to the
// store's repository even when the server's environment points git elsewhere.
func TestStoreIgnoresInheritedGitEnv(t *testing.T) {
	r := newTestRepo(t)
	mine := r.blob("mine")
	s := r.open()
	other := &testRepo{t: t, work: t.TempDir()}
	other.gitDir = filepath.Join(other.work, ".git")
	other.git(nil, "", "init", "-q", other.work)
	theirs := other.blob("theirs")
	t.Setenv("GIT_DIR", other.gitDir)
	t.Setenv("GIT_OBJECT_DIRECTORY", filepath.Join(other.gitDir, "objects"))
	t.Setenv("GIT_ALTERNATE_OBJECT_DIRECTORIES", filepath.Join(other.gitDir, "objects"))
	t.Setenv("GIT_INDEX_FILE", filepath.Join(other.gitDir, "index"))
	t.Setenv("GIT_WORK_TREE", other.work)
	if _, data, err := s.Read(ctxT(t), mine); err != nil || string(data) != "mine" {
		t.Fatalf("Read own object: %q, %v", data, err)
	}
	if _, _, err := s.Read(ctxT(t), theirs); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Read other repository's object: %v, want ErrNotFound", err)
	}
}

// TestReadIgnoresReplaceRefs checks that Read returns the object asked for,
// not a replacement, since callers hash and compare what they read.
func TestReadIgnoresReplaceRefs(t *testing.T) {
	r := newTestRepo(t)
	a, b := r.blob("original"), r.blob("replacement")
	r.git(nil, "", "replace", a.String(), b.String())
	s := r.open()
	if _, data, err := s.Read(ctxT(t), a); err != nil || string(data) != "original" {
		t.Fatalf("Read = %q, %v; want the original", data, err)
	}
}

// Objects of every size around the stored bound (written in stored zlib
// blocks up to storedMax, compressed above) read back the same through
// git, and a stored object is what zlib itself reads.
func TestWriteSizesAroundTheStoredBound(t *testing.T) {
	r := newTestRepo(t)
	s := r.open()
	for _, n := range []int{0, 1, storedMax - 1, storedMax, storedMax + 1, 200 << 10} {
		data := bytes.Repeat([]byte("abcdefghij\n"), n/11+1)[:n]
		oid, err := s.Write("blob", data)
		if err != nil {
			t.Fatal(err)
		}
		if got := r.git(nil, "", "cat-file", "-p", oid.String()); got != string(data) {
			t.Fatalf("%d bytes: git reads %d bytes back", n, len(got))
		}
		raw, err := os.ReadFile(filepath.Join(r.gitDir, "objects", oid.String()[:2], oid.String()[2:]))
		if err != nil {
			t.Fatal(err)
		}
		zr, err := zlib.NewReader(bytes.NewReader(raw))
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(zr)
		if err != nil || !bytes.Equal(got, append(objectHeader("blob", n), data...)) {
			t.Fatalf("%d bytes: zlib reads %d bytes (%v)", n, len(got), err)
		}
		if stored := len(raw) > n; stored != (n <= storedMax) {
			t.Fatalf("%d bytes: %d on disk", n, len(raw))
		}
	}
	r.git(nil, "", "fsck", "--strict")
}

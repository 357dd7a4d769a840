package gitobj

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// checkEdit runs EditTree and the index reference on the same input and
// compares the trees, then checks that our result's trees are all on disk
// (before the reference writes its own copies) and that the diff matches
// git's.
func checkEdit(t *testing.T, r *testRepo, s *Store, name string, base OID, changes []Change) OID {
	t.Helper()
	got, err := s.EditTree(ctxT(t), base, changes)
	if err != nil {
		t.Fatalf("%s: EditTree: %v", name, err)
	}
	if _, errOut, err := r.tryGit(nil, "", "ls-tree", "-r", "-t", got.String()); err != nil {
		t.Fatalf("%s: result tree %s not fully written: %v\n%s", name, got, err, errOut)
	}
	want := r.indexTree(base, changes)
	if got != want {
		t.Fatalf("%s: EditTree = %s, git index gives %s\nours:\n%s\ngit's:\n%s", name, got, want,
			r.git(nil, "", "ls-tree", "-r", "-t", got.String()), r.git(nil, "", "ls-tree", "-r", "-t", want.String()))
	}
	checkDiff(t, r, s, name, base, got)
	return got
}

func checkDiff(t *testing.T, r *testRepo, s *Store, name string, a, b OID) {
	t.Helper()
	for _, pair := range [][2]OID{{a, b}, {b, a}} {
		got, err := s.DiffTrees(ctxT(t), pair[0], pair[1])
		if err != nil {
			t.Fatalf("%s: DiffTrees: %v", name, err)
		}
		want := r.gitDiff(pair[0], pair[1])
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%s: DiffTrees(%s, %s) differs from git diff-tree\n got %v\nwant %v", name, pair[0], pair[1], got, want)
		}
	}
}

func TestEditTreeMatchesIndex(t *testing.T) {
	r := newTestRepo(t)
	s := r.open()
	b := func(c string) OID { return r.blob(c) }
	set := func(p string, c string) Change { return Change{Path: p, Mode: ModeFile, OID: b(c)} }
	del := func(p string) Change { return Change{Path: p} }

	base := checkEdit(t, r, s, "build base", OID{}, []Change{
		set("README", "readme"),
		set("dir/a.txt", "a"),
		set("dir/b.txt", "b"),
		set("dir/sub/c.txt", "c"),
		set("deep/one/two/only.txt", "only"),
		set("f", "a file"),
		set("a", "plain a"),
		set("a.b", "a.b"),
		set("a-b/x", "a-b/x"),
		set("a0", "a0"),
		set("ä/日本", "utf8"),
	})
	exec := Change{Path: "bin/run", Mode: ModeExec, OID: b("#!/bin/sh\n")}
	link := Change{Path: "dir/link", Mode: ModeSymlink, OID: b("a.txt")}
	gitlink := Change{Path: "vendor/mod", Mode: ModeGitlink, OID: fakeOID(7)}

	scenarios := []struct {
		name    string
		changes []Change
	}{
		{"no changes", nil},
		{"add in new nested dirs", []Change{set("x/y/z/new.txt", "new"), set("dir/sub/new/deeper/n", "n")}},
		{"modify", []Change{set("dir/a.txt", "a2"), set("README", "readme2")}},
		{"modify to same content", []Change{set("dir/a.txt", "a")}},
		{"delete making dirs empty", []Change{del("deep/one/two/only.txt")}},
		{"delete one of several", []Change{del("dir/b.txt")}},
		{"delete nonexistent", []Change{del("nope"), del("dir/nope"), del("f/below/file"), del("x/y/z")}},
		{"file to dir", []Change{set("f/g/h.txt", "h")}},
		{"file a to dir around a.b and a0", []Change{set("a/inner", "inner")}},
		{"dir to file", []Change{set("dir", "now a file")}},
		{"dir to file then dir again", []Change{set("dir", "file"), set("dir/again", "again")}},
		{"file to dir then file again", []Change{set("f/g", "g"), set("f", "file again")}},
		{"delete dir recursively", []Change{del("dir")}},
		{"exec symlink gitlink", []Change{exec, link, gitlink}},
		{"mode change only", []Change{{Path: "dir/a.txt", Mode: ModeExec, OID: b("a")}}},
		{"type change file to symlink", []Change{{Path: "README", Mode: ModeSymlink, OID: b("readme")}}},
		{"later change wins", []Change{set("dir/a.txt", "first"), set("dir/a.txt", "second"), del("README"), set("README", "back")}},
		{"add then delete", []Change{set("tmp/t", "t"), del("tmp/t")}},
		{"delete everything", []Change{del("README"), del("dir/a.txt"), del("dir/b.txt"), del("dir/sub/c.txt"),
			del("deep/one/two/only.txt"), del("f"), del("a"), del("a.b"), del("a-b/x"), del("a0"), del("ä/日本")}},
		{"delete everything by directory", []Change{del("README"), del("dir"), del("deep"), del("f"), del("a"), del("a.b"),
			del("a-b"), del("a0"), del("ä")}},
	}
	for _, sc := range scenarios {
		got := checkEdit(t, r, s, sc.name, base, sc.changes)
		if strings.HasPrefix(sc.name, "delete everything") {
			if got != emptyTreeOID {
				t.Fatalf("%s: got %s, want the empty tree", sc.name, got)
			}
		}
	}
	checkEdit(t, r, s, "from zero", OID{}, []Change{set("only/file", "x")})
	r.fsck()
}

// TestEditTreeWritesEmptyRoot checks that an empty result is stored, not
// just known to git (whose write-tree would store it, so this runs in
// repositories the reference never touches).
func TestEditTreeWritesEmptyRoot(t *testing.T) {
	for _, deleteAll := range []bool{false, true} {
		r := newTestRepo(t)
		s := r.open()
		var base OID
		var changes []Change
		if deleteAll {
			var err error
			base, err = s.EditTree(ctxT(t), OID{}, []Change{{Path: "d/f", Mode: ModeFile, OID: r.blob("f")}})
			if err != nil {
				t.Fatal(err)
			}
			changes = []Change{{Path: "d/f"}}
		}
		got, err := s.EditTree(ctxT(t), base, changes)
		if err != nil || got != emptyTreeOID {
			t.Fatalf("EditTree(%s, %v) = %s, %v; want the empty tree", base, changes, got, err)
		}
		hex := emptyTreeOID.String()
		if _, err := os.Stat(filepath.Join(r.gitDir, "objects", hex[:2], hex[2:])); err != nil {
			t.Fatalf("empty tree not written: %v", err)
		}
	}
}

func TestEditTreeInvalid(t *testing.T) {
	r := newTestRepo(t)
	s := r.open()
	id := r.blob("x")
	bad := []Change{
		{Path: "", Mode: ModeFile, OID: id},
		{Path: "/a", Mode: ModeFile, OID: id},
		{Path: "a/", Mode: ModeFile, OID: id},
		{Path: "a//b", Mode: ModeFile, OID: id},
		{Path: "./a", Mode: ModeFile, OID: id},
		{Path: "a/../b", Mode: ModeFile, OID: id},
		{Path: "..", Mode: 0},
		{Path: "a\x00b", Mode: ModeFile, OID: id},
		{Path: ".git/config", Mode: ModeFile, OID: id},
		{Path: "sub/.GIT", Mode: ModeFile, OID: id},
		{Path: "a", Mode: ModeTree, OID: emptyTreeOID},
		{Path: "a", Mode: 0o100664, OID: id},
		{Path: "a", Mode: ModeFile},
	}
	for _, ch := range bad {
		if got, err := s.EditTree(ctxT(t), OID{}, []Change{{Path: "ok", Mode: ModeFile, OID: id}, ch}); err == nil {
			t.Errorf("EditTree accepted %+v: %s", ch, got)
		}
	}
	if _, err := s.EditTree(ctxT(t), id, []Change{{Path: "x", Mode: ModeFile, OID: id}}); err == nil {
		t.Error("EditTree on a blob base succeeded")
	}
}

// TestEditTreeReadsOnlyChangedPaths checks the cost guarantee: an edit or a
// diff reads the trees along the changed paths, not the whole repository.
func TestEditTreeReadsOnlyChangedPaths(t *testing.T) {
	r := newTestRepo(t)
	s := r.open()
	x := r.blob("x")
	var changes []Change
	for i := range 20 {
		for j := range 5 {
			changes = append(changes, Change{Path: fmt.Sprintf("d%d/s%d/f", i, j), Mode: ModeFile, OID: x})
		}
	}
	base, err := s.EditTree(ctxT(t), OID{}, changes)
	if err != nil {
		t.Fatal(err)
	}
	s2 := r.open()
	y := r.blob("y")
	edited, err := s2.EditTree(ctxT(t), base, []Change{{Path: "d7/s3/f", Mode: ModeFile, OID: y}, {Path: "d7/s3/new/g", Mode: ModeFile, OID: y}})
	if err != nil {
		t.Fatal(err)
	}
	if n := s2.treeReads.Load(); n != 3 { // root, d7, d7/s3
		t.Errorf("EditTree read %d trees, want 3", n)
	}
	s3 := r.open()
	d, err := s3.DiffTrees(ctxT(t), base, edited)
	if err != nil {
		t.Fatal(err)
	}
	if len(d) != 2 {
		t.Errorf("diff = %v", d)
	}
	// root, d7, d7/s3 on each side, then new/ against the (free) empty tree.
	if n := s3.treeReads.Load(); n != 8 {
		t.Errorf("DiffTrees read %d trees, want 8", n)
	}
	checkDiff(t, r, s, "cost", base, edited)
}

func TestLookup(t *testing.T) {
	r := newTestRepo(t)
	s := r.open()
	x, y := r.blob("x"), r.blob("y")
	root, err := s.EditTree(ctxT(t), OID{}, []Change{
		{Path: "a", Mode: ModeFile, OID: x}, {Path: "a.b/c", Mode: ModeExec, OID: y}, {Path: "a0/l", Mode: ModeSymlink, OID: x},
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		path string
		want Entry
		ok   bool
	}{
		{"a", Entry{Name: "a", Mode: ModeFile, OID: x}, true},
		{"a.b/c", Entry{Name: "c", Mode: ModeExec, OID: y}, true},
		{"a0/l", Entry{Name: "l", Mode: ModeSymlink, OID: x}, true},
		{"a/c", Entry{}, false},
		{"a.b/d", Entry{}, false},
		{"zz", Entry{}, false},
	} {
		e, ok, err := s.Lookup(ctxT(t), root, tc.path)
		if err != nil || ok != tc.ok || e != tc.want {
			t.Errorf("Lookup(%q) = %v, %v, %v; want %v, %v", tc.path, e, ok, err, tc.want, tc.ok)
		}
		// And git agrees.
		out := r.git(nil, "", "ls-tree", root.String(), "--", tc.path)
		if (out != "") != tc.ok {
			t.Errorf("git ls-tree %q = %q", tc.path, out)
		}
	}
	e, ok, err := s.Lookup(ctxT(t), root, "a.b")
	if err != nil || !ok || e.Mode != ModeTree {
		t.Errorf("Lookup(a.b) = %v %v %v", e, ok, err)
	}
	if _, _, err := s.Lookup(ctxT(t), root, "a//b"); err == nil {
		t.Error("Lookup accepted an invalid path")
	}
}

// TestEditAndDiffRandom compares EditTree and DiffTrees with git on random
// edits over names chosen to collide in git's ordering.
func TestEditAndDiffRandom(t *testing.T) {
	r := newTestRepo(t)
	s := r.open()
	rng := rand.New(rand.NewPCG(1, 2))
	names := []string{"a", "a.b", "a-b", "a0", "b", "ä"}
	modes := []uint32{ModeFile, ModeFile, ModeFile, ModeExec, ModeSymlink, ModeGitlink}
	var blobs []OID
	for i := range 4 {
		blobs = append(blobs, r.blob(fmt.Sprint("content ", i)))
	}
	randPath := func() string {
		n := 1 + rng.IntN(3)
		parts := make([]string, n)
		for i := range parts {
			parts[i] = names[rng.IntN(len(names))]
		}
		return strings.Join(parts, "/")
	}
	randChanges := func(n int) []Change {
		var cs []Change
		for range n {
			if rng.IntN(3) == 0 {
				cs = append(cs, Change{Path: randPath()})
				continue
			}
			cs = append(cs, Change{Path: randPath(), Mode: modes[rng.IntN(len(modes))], OID: blobs[rng.IntN(len(blobs))]})
		}
		return cs
	}
	iterations := 25
	if testing.Short() {
		iterations = 5
	}
	for it := range iterations {
		base := checkEdit(t, r, s, fmt.Sprintf("random base %d", it), OID{}, randChanges(25))
		next := checkEdit(t, r, s, fmt.Sprintf("random edit %d", it), base, randChanges(1+rng.IntN(8)))
		checkDiff(t, r, s, fmt.Sprintf("random diff %d", it), OID{}, next)
	}
	r.fsck()
}

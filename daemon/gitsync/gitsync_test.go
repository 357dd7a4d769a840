package gitsync

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/internal/testutil"
)

// pushAndCompare pushes and checks the sandbox now holds exactly the local
// working tree (ignored files aside, which neither side has here).
func (f *fixture) pushAndCompare() *Patch {
	f.t.Helper()
	p := f.push()
	assertTree(f.t, f.sandbox, tree(f.t, f.local))
	return p
}

// Parity: a new local file and an edited tracked file are seen in the
// sandbox with the same content and are unchanged locally afterwards.
func TestParityLocalChangesSeenInSandbox(t *testing.T) {
	f := newFixture(t, map[string]string{"README.md": "hello\n"})
	writeFiles(t, f.local, map[string]string{"new.txt": "brand new\n", "README.md": "edited\n"})
	want := tree(t, f.local)
	index := fileBytes(t, filepath.Join(f.local, ".git", "index"))

	out, res, err := f.exec(`cat new.txt README.md; bash -c "echo hello world"`)
	if err != nil {
		t.Fatal(err)
	}
	if out != "brand new\nedited\nhello world\n" {
		t.Fatalf("sandbox saw %q", out)
	}
	if len(res.Files) != 0 || res.Bytes != 0 {
		t.Fatalf("pulled %v (%d bytes), want nothing", res.Files, res.Bytes)
	}
	assertTree(t, f.local, want)
	if !bytes.Equal(index, fileBytes(t, filepath.Join(f.local, ".git", "index"))) {
		t.Fatal("the local index changed")
	}
}

// Parity: a file the command creates and a tracked file it edits come back.
func TestParitySandboxEditsComeBack(t *testing.T) {
	f := newFixture(t, map[string]string{"README.md": "hello\n", "keep.txt": "keep\n"})
	before := tree(t, f.local)
	_, res, err := f.exec("echo created > made.txt && echo changed > README.md && mkdir -p out/deep && echo x > 'out/deep/f.txt'")
	if err != nil {
		t.Fatal(err)
	}
	assertTree(t, f.local, withFiles(before, map[string]string{"made.txt": "created\n", "README.md": "changed\n", "out/deep/f.txt": "x\n"}))
	if got := strings.Join(res.Files, ","); got != "README.md,made.txt,out/deep/f.txt" {
		t.Fatalf("pulled files %q", got)
	}
	// Pulled files are working-tree changes, not staged.
	if st := testutil.Git(t, f.local, "diff", "--cached", "--name-only"); st != "" {
		t.Fatalf("pull staged %q", st)
	}
}

// Parity: a file created locally, seen by one exec, then deleted locally,
// does not come back after the next exec.
func TestParityDeletedLocalFileDoesNotComeBack(t *testing.T) {
	f := newFixture(t, map[string]string{"README.md": "hello\n"})
	writeFile(t, filepath.Join(f.local, "temp.txt"), "temporary\n")
	if out, _, err := f.exec("cat temp.txt"); err != nil || out != "temporary\n" {
		t.Fatalf("first exec: %q %v", out, err)
	}
	if err := os.Remove(filepath.Join(f.local, "temp.txt")); err != nil {
		t.Fatal(err)
	}
	want := tree(t, f.local)
	out, res, err := f.exec("ls")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(out, "temp.txt") {
		t.Fatalf("the sandbox still has temp.txt: %q", out)
	}
	if len(res.Files) != 0 {
		t.Fatalf("pulled %v", res.Files)
	}
	assertTree(t, f.local, want)
}

// Parity: an unpushed local commit plus an uncommitted file survive an exec
// untouched (and the sandbox sees both).
func TestParityUnpushedCommitAndUncommittedFile(t *testing.T) {
	f := newFixture(t, map[string]string{"README.md": "hello\n"})
	writeFile(t, filepath.Join(f.local, "committed.txt"), "local commit\n")
	testutil.Git(t, f.local, "add", "committed.txt")
	testutil.Git(t, f.local, "commit", "-q", "-m", "unpushed")
	head := testutil.Git(t, f.local, "rev-parse", "HEAD")
	writeFile(t, filepath.Join(f.local, "wip.txt"), "work in progress\n")
	want := tree(t, f.local)
	index := fileBytes(t, filepath.Join(f.local, ".git", "index"))

	f.r.reset()
	p := f.push()
	if strings.Contains(string(p.Data), "committed.txt") || !strings.Contains(string(p.Data), "wip.txt") {
		t.Fatalf("the patch should hold only the uncommitted file:\n%s", p.Data)
	}
	if f.r.log[0] != ReceivePackCommand {
		t.Fatalf("the commit did not travel by git push: first call %q", f.r.log[0])
	}
	out := f.inSandbox("cat committed.txt wip.txt; git rev-parse HEAD " + PushRef)
	if out != "local commit\nwork in progress\n"+head+"\n"+head+"\n" {
		t.Fatalf("sandbox saw %q", out)
	}
	if _, err := f.pull(); err != nil {
		t.Fatal(err)
	}
	// The next exec finds the commit there: no second push.
	if _, _, err := f.exec("true"); err != nil {
		t.Fatal(err)
	}
	assertTree(t, f.local, want)
	if testutil.Git(t, f.local, "rev-parse", "HEAD") != head {
		t.Fatal("HEAD moved")
	}
	if !bytes.Equal(index, fileBytes(t, filepath.Join(f.local, ".git", "index"))) {
		t.Fatal("the local index changed")
	}
}

func TestBinaryBothWays(t *testing.T) {
	bin := randomBytes(3000, 1) + "\x00\xff"
	f := newFixture(t, map[string]string{"img.bin": bin})
	writeFile(t, filepath.Join(f.local, "img.bin"), randomBytes(2000, 2))
	writeFile(t, filepath.Join(f.local, "new.bin"), randomBytes(500, 3)+"\x00")
	f.pushAndCompare()
	f.inSandbox("head -c 4000 /dev/urandom > made.bin && cp new.bin img.bin")
	want := tree(t, f.sandbox)
	res, err := f.pull()
	if err != nil {
		t.Fatal(err)
	}
	assertTree(t, f.local, want)
	if strings.Join(res.Files, ",") != "img.bin,made.bin" {
		t.Fatalf("pulled %v", res.Files)
	}
}

func TestRenameBothWays(t *testing.T) {
	body := strings.Repeat("a line of text that makes this file recognisable\n", 20)
	f := newFixture(t, map[string]string{"old.txt": body, "other.txt": body + "other\n"})
	if err := os.Rename(filepath.Join(f.local, "old.txt"), filepath.Join(f.local, "renamed.txt")); err != nil {
		t.Fatal(err)
	}
	p := f.pushAndCompare()
	if !bytes.Contains(p.Data, []byte("rename from old.txt")) {
		t.Fatalf("patch does not record a rename:\n%s", p.Data)
	}
	f.inSandbox("mv other.txt moved.txt")
	want := tree(t, f.sandbox)
	res, err := f.pull()
	if err != nil {
		t.Fatal(err)
	}
	assertTree(t, f.local, want)
	if strings.Join(res.Files, ",") != "moved.txt" {
		t.Fatalf("pulled %v", res.Files)
	}
}

func TestDeletionBothWays(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n", "b.txt": "b\n", "dir/c.txt": "c\n"})
	if err := os.Remove(filepath.Join(f.local, "a.txt")); err != nil {
		t.Fatal(err)
	}
	// A deletion that is staged counts the same.
	testutil.Git(t, f.local, "rm", "-q", "dir/c.txt")
	f.pushAndCompare()
	f.inSandbox("rm b.txt")
	want := tree(t, f.sandbox)
	res, err := f.pull()
	if err != nil {
		t.Fatal(err)
	}
	assertTree(t, f.local, want)
	if len(want) != 0 || strings.Join(res.Files, ",") != "b.txt" {
		t.Fatalf("want an empty tree, pulled %v", res.Files)
	}
}

func TestModeChangeBothWays(t *testing.T) {
	f := newFixture(t, map[string]string{"run.sh": "#!/bin/sh\necho run\n", "tool.sh": "#!/bin/sh\necho tool\n"})
	if err := os.Chmod(filepath.Join(f.local, "run.sh"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("run.sh", filepath.Join(f.local, "link.sh")); err != nil {
		t.Fatal(err)
	}
	f.pushAndCompare()
	if out := f.inSandbox("./run.sh"); out != "run\n" {
		t.Fatalf("run.sh in sandbox: %q", out)
	}
	f.inSandbox("chmod +x tool.sh && chmod -x run.sh")
	want := tree(t, f.sandbox)
	if _, err := f.pull(); err != nil {
		t.Fatal(err)
	}
	assertTree(t, f.local, want)
	if want["tool.sh"][:10] != "-rwxr-xr-x" {
		t.Fatalf("the sandbox did not chmod: %s", want["tool.sh"][:10])
	}
}

// (A name with a control character, a tab included, is refused on the way
// back: TestPullRefusesWhatLocalToolsWouldRunOrMisread.)
func TestHostileNamesBothWays(t *testing.T) {
	names := []string{"with space.txt", `qu'o"te.txt`, "ünï cødé/名前.txt", "star*[x]?.txt", "-dash.txt"}
	f := newFixture(t, map[string]string{names[0]: "tracked\n"})
	for i, n := range names {
		writeFile(t, filepath.Join(f.local, n), "local "+n+"\n"+randomBytes(i, byte(i)))
	}
	f.pushAndCompare()
	// The command edits every one of them and adds a sibling of each.
	f.inSandbox(`for f in *.txt */*.txt; do printf 'sandbox\n' >> "$f"; cp -- "$f" "$f.copy"; done`)
	want := tree(t, f.sandbox)
	res, err := f.pull()
	if err != nil {
		t.Fatal(err)
	}
	assertTree(t, f.local, want)
	if len(res.Files) != 2*len(names) {
		t.Fatalf("pulled %d files: %q", len(res.Files), res.Files)
	}
}

// The local file changed during the exec where the sandbox changed it too:
// a 3-way merge leaves markers holding both sides, the patch is saved.
func TestConflictThreeWay(t *testing.T) {
	lines := "one\ntwo\nthree\nfour\nfive\nsix\nseven\neight\nnine\n"
	f := newFixture(t, map[string]string{"f.txt": lines, "clean.txt": "clean\n"})
	writeFile(t, filepath.Join(f.local, "f.txt"), strings.Replace(lines, "two", "two (pushed)", 1))
	f.push()
	f.inSandbox("sed -i 's/^three$/three (sandbox)/' f.txt && echo sandbox > clean.txt && echo new > new.txt")
	// Meanwhile the user edits the same lines locally.
	writeFile(t, filepath.Join(f.local, "f.txt"), strings.Replace(lines, "two", "two (local, during exec)", 1))
	index := fileBytes(t, filepath.Join(f.local, ".git", "index"))

	res, err := f.pull()
	var ce *ConflictError
	if !errors.As(err, &ce) || !errors.Is(err, ErrConflict) || !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("want a conflict, got %v", err)
	}
	if strings.Join(ce.ConflictFiles, ",") != "f.txt" || strings.Join(res.ConflictFiles, ",") != "f.txt" {
		t.Fatalf("conflict files %v / %v", ce.ConflictFiles, res.ConflictFiles)
	}
	got := string(fileBytes(t, filepath.Join(f.local, "f.txt")))
	for _, side := range []string{"two (local, during exec)", "three (sandbox)", "<<<<<<< ours", ">>>>>>> theirs"} {
		if !strings.Contains(got, side) {
			t.Fatalf("f.txt lost %q:\n%s", side, got)
		}
	}
	// The rest applied; the saved patch is the sandbox's full patch.
	if string(fileBytes(t, filepath.Join(f.local, "clean.txt"))) != "sandbox\n" || string(fileBytes(t, filepath.Join(f.local, "new.txt"))) != "new\n" {
		t.Fatal("the non-conflicting changes were not applied")
	}
	saved := fileBytes(t, ce.SavedPatch)
	if !strings.HasPrefix(ce.SavedPatch, filepath.Join(f.local, ".git", "sandboxd", "pulls")) || !bytes.Contains(saved, []byte("+three (sandbox)")) {
		t.Fatalf("saved patch %s:\n%s", ce.SavedPatch, saved)
	}
	if !strings.Contains(err.Error(), ce.SavedPatch) {
		t.Fatalf("the error does not name the saved patch: %v", err)
	}
	if !bytes.Equal(index, fileBytes(t, filepath.Join(f.local, ".git", "index"))) {
		t.Fatal("the 3-way merge touched the user's index")
	}
	// The next exec warns about the markers still there.
	p, err := f.s.Prepare(context.Background(), f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	// With no .rej file, the advice is about the markers only.
	if w := strings.Join(p.Warnings, "\n"); !strings.Contains(w, "conflict markers in f.txt") || strings.Contains(w, ".rej") {
		t.Fatalf("warnings %q", w)
	}
}

// When a 3-way merge is impossible (here the pushed blobs were pruned), the
// hunks that apply are applied, the rest go to .rej files, nothing is lost.
func TestConflictRejectFiles(t *testing.T) {
	lines := "one\ntwo\nthree\nfour\nfive\nsix\nseven\neight\nnine\nten\neleven\ntwelve\n"
	f := newFixture(t, map[string]string{"f.txt": lines})
	pushed := strings.Replace(lines, "one", "one (pushed)", 1)
	writeFile(t, filepath.Join(f.local, "f.txt"), pushed)
	f.push()
	f.inSandbox("sed -i -e 's/^two$/two (sandbox)/' -e 's/^eleven$/eleven (sandbox)/' f.txt")
	local := strings.Replace(pushed, "two", "two (local)", 1)
	writeFile(t, filepath.Join(f.local, "f.txt"), local)
	testutil.Git(t, f.local, "gc", "-q", "--prune=now")

	res, err := f.pull()
	var ce *ConflictError
	if !errors.As(err, &ce) {
		t.Fatalf("want a conflict, got %v", err)
	}
	if strings.Join(ce.RejectFiles, ",") != "f.txt.rej" || strings.Join(res.RejectFiles, ",") != "f.txt.rej" {
		t.Fatalf("reject files %v", ce.RejectFiles)
	}
	// The hunk that applied is there, the local edit is kept, the rejected
	// hunk is in the .rej and in the saved patch.
	want := strings.Replace(local, "eleven", "eleven (sandbox)", 1)
	if got := string(fileBytes(t, filepath.Join(f.local, "f.txt"))); got != want {
		t.Fatalf("f.txt = %q, want %q", got, want)
	}
	if !bytes.Contains(fileBytes(t, filepath.Join(f.local, "f.txt.rej")), []byte("+two (sandbox)")) {
		t.Fatal("the .rej lacks the rejected hunk")
	}
	if !bytes.Contains(fileBytes(t, ce.SavedPatch), []byte("+two (sandbox)")) {
		t.Fatal("the saved patch lacks the rejected hunk")
	}
	p, err := f.s.Prepare(context.Background(), f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	if w := strings.Join(p.Warnings, "\n"); !strings.Contains(w, ".rej files f.txt.rej") {
		t.Fatalf("warnings %q", w)
	}
	// Once resolved, the warning goes away.
	if err := os.Remove(filepath.Join(f.local, "f.txt.rej")); err != nil {
		t.Fatal(err)
	}
	if p, err = f.s.Prepare(context.Background(), f.local, f.base); err != nil || len(p.Warnings) != 0 {
		t.Fatalf("warnings after resolving: %q %v", p.Warnings, err)
	}
}

// The daemon died between the command's end and its pull (no Pull call):
// the next push brings the sandbox's edits back first (a conflict with a
// local edit made meanwhile keeps both sides), says so, then heals the
// sandbox to exactly the local tree.
func TestUnpulledEditsComeBackBeforeTheNextPush(t *testing.T) {
	f := newFixture(t, map[string]string{"README.md": "hello\n", "src/a.go": "package a\n"})
	writeFile(t, filepath.Join(f.local, "wip.txt"), "mine\n")
	f.push()
	f.inSandbox("echo half > README.md && echo junk > junk.txt && mkdir -p gen && echo g > gen/x && git add junk.txt && " +
		"git -c user.name=x -c user.email=x@x commit -q -m oops && echo more >> src/a.go && rm wip.txt")
	// No pull: the daemon died. The user keeps working.
	writeFile(t, filepath.Join(f.local, "wip.txt"), "mine, later\n")

	ctx := context.Background()
	p, err := f.s.Prepare(ctx, f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	res, err := f.s.Push(ctx, f.r, p)
	if err != nil {
		t.Fatal(err)
	}
	if !res.Again || res.Recovered == nil || !strings.Contains(strings.Join(res.Warnings, "\n"), "never pulled") {
		t.Fatalf("push result %+v", res)
	}
	if got := strings.Join(res.Recovered.Files, ","); got != "README.md,gen/x,junk.txt,src/a.go,wip.txt" {
		t.Fatalf("recovered files %q", got)
	}
	saved := string(fileBytes(t, res.Recovered.SavedPatch))
	if !strings.Contains(saved, "junk.txt") || !strings.Contains(saved, "deleted file mode") {
		t.Fatalf("saved copy:\n%s", saved)
	}
	for name, want := range map[string]string{"README.md": "half\n", "junk.txt": "junk\n", "gen/x": "g\n", "src/a.go": "package a\nmore\n", "wip.txt": "mine, later\n"} {
		if got := string(fileBytes(t, filepath.Join(f.local, name))); got != want {
			t.Fatalf("%s = %q, want %q", name, got, want)
		}
	}
	// Pushed again, the sandbox is exactly the local tree.
	f.pushAndCompare()
	if got := strings.TrimSpace(testutil.Git(t, f.sandbox, "rev-parse", "HEAD")); got != f.base {
		t.Fatalf("sandbox HEAD %s, want base %s", got, f.base)
	}
}

// The daemon died after applying a pull but before acknowledging it: the
// next push finds the edits already applied and applies nothing twice.
func TestPulledButNotAcknowledged(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	f.push()
	f.inSandbox("echo sandbox >> a.txt && echo n > n.txt")
	if _, err := f.pull(); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(f.local, ".git", "sandboxd", ackFile)); err != nil {
		t.Fatal(err)
	}
	want := tree(t, f.local)
	ctx := context.Background()
	p, err := f.s.Prepare(ctx, f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	res, err := f.s.Push(ctx, f.r, p)
	if err != nil || res.Again || len(res.Warnings) != 0 {
		t.Fatalf("push: %+v %v", res, err)
	}
	assertTree(t, f.local, want)
	assertTree(t, f.sandbox, want)
}

// Normalize before, not after: what the command generated stays in the
// sandbox after the exec (ignored build output too, for a dev server),
// survives to the next exec, and a file deleted locally still does not come
// back.
func TestGeneratedFilesStayDeletedDoNotComeBack(t *testing.T) {
	f := newFixture(t, map[string]string{".gitignore": "dist/\n", "a.txt": "a\n"})
	if _, _, err := f.exec("mkdir -p dist && echo built > dist/app.js && echo gen > gen.txt"); err != nil {
		t.Fatal(err)
	}
	if got := f.inSandbox("cat dist/app.js gen.txt"); got != "built\ngen\n" {
		t.Fatalf("after the exec the sandbox has %q", got)
	}
	if _, err := os.Stat(filepath.Join(f.local, "dist")); err == nil {
		t.Fatal("ignored output was pulled")
	}
	if err := os.Remove(filepath.Join(f.local, "gen.txt")); err != nil {
		t.Fatal(err)
	}
	out, res, err := f.exec("cat dist/app.js; ls")
	if err != nil || len(res.Files) != 0 {
		t.Fatalf("second exec: %v %v", res.Files, err)
	}
	if !strings.HasPrefix(out, "built\n") || strings.Contains(out, "gen.txt") {
		t.Fatalf("second exec saw %q", out)
	}
	if _, err := os.Stat(filepath.Join(f.local, "gen.txt")); err == nil {
		t.Fatal("the deleted file came back")
	}
}

// Fifty unpushed local commits reach the sandbox by git's push protocol:
// its HEAD and log have them, and the patch carries none of them.
func TestFiftyUnpushedCommitsArePushed(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	for i := 0; i < 50; i++ {
		writeFile(t, filepath.Join(f.local, fmt.Sprintf("c%02d.txt", i)), fmt.Sprintf("commit %d\n", i))
		testutil.Git(t, f.local, "add", "-A")
		testutil.Git(t, f.local, "commit", "-q", "-m", fmt.Sprintf("commit %d", i))
	}
	head := strings.TrimSpace(testutil.Git(t, f.local, "rev-parse", "HEAD"))
	f.r.reset()
	p := f.push()
	if len(p.Data) != 0 || f.r.log[0] != ReceivePackCommand {
		t.Fatalf("patch %d bytes, first call %q", len(p.Data), f.r.log[0])
	}
	if got := strings.TrimSpace(testutil.Git(t, f.sandbox, "rev-parse", "HEAD")); got != head {
		t.Fatalf("sandbox HEAD %s, want %s", got, head)
	}
	if n := strings.TrimSpace(testutil.Git(t, f.sandbox, "rev-list", "--count", f.base+".."+head)); n != "50" {
		t.Fatalf("sandbox log has %s new commits", n)
	}
	assertTree(t, f.sandbox, tree(t, f.local))
}

// LFS-tracked files are detected from .gitattributes alone: changed ones are
// named and not synced either way.
func TestLFSFilesWarned(t *testing.T) {
	f := newFixture(t, map[string]string{".gitattributes": "*.psd filter=lfs diff=lfs merge=lfs -text\n", "art.psd": "pointer\n", "code.txt": "code\n"})
	writeFile(t, filepath.Join(f.local, "art.psd"), "big local binary\n")
	writeFile(t, filepath.Join(f.local, "new art.psd"), "another\n")
	writeFile(t, filepath.Join(f.local, "code.txt"), "code edited\n")
	want := tree(t, f.local)
	p := f.push()
	if strings.Join(p.LFSFiles, ",") != "art.psd,new art.psd" || len(p.Warnings) != 1 ||
		!strings.Contains(p.Warnings[0], "art.psd, new art.psd") || !strings.Contains(p.Warnings[0], "LFS") {
		t.Fatalf("LFS files %v, warnings %q", p.LFSFiles, p.Warnings)
	}
	if strings.Join(p.Files, ",") != "code.txt" {
		t.Fatalf("patch files %v", p.Files)
	}
	delete(want, "new art.psd")
	assertTree(t, f.sandbox, withFiles(want, map[string]string{"art.psd": "pointer\n"}))

	// The sandbox changing an LFS file: skipped locally, kept in a patch.
	f.inSandbox("echo sandbox > art.psd && echo more >> code.txt")
	res, err := f.pull()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(res.SkippedLFS, ",") != "art.psd" || res.SavedPatch == "" || len(res.Warnings) != 1 {
		t.Fatalf("skipped %v saved %q warnings %q", res.SkippedLFS, res.SavedPatch, res.Warnings)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "art.psd"))); got != "big local binary\n" {
		t.Fatalf("art.psd = %q", got)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "code.txt"))); got != "code edited\nmore\n" {
		t.Fatalf("code.txt = %q", got)
	}
}

// No origin: sync works against the base commit when the sandbox has it.
func TestNoOriginRepository(t *testing.T) {
	isolate(t)
	root := t.TempDir()
	local, sandbox := filepath.Join(root, "local"), filepath.Join(root, "sandbox")
	testutil.Git(t, root, "init", "-q", "-b", "main", local)
	writeFile(t, filepath.Join(local, "a.txt"), "a\n")
	testutil.Git(t, local, "add", "-A")
	testutil.Git(t, local, "commit", "-q", "-m", "base")
	testutil.Git(t, root, "clone", "-q", local, sandbox)
	if out := testutil.Git(t, local, "remote"); out != "" {
		t.Fatalf("remotes: %q", out)
	}
	f := &fixture{t: t, local: local, sandbox: sandbox, s: New(Options{}), r: &sandboxRunner{dir: sandbox},
		base: strings.TrimSpace(testutil.Git(t, local, "rev-parse", "HEAD"))}
	writeFile(t, filepath.Join(local, "b.txt"), "b\n")
	out, _, err := f.exec("cat b.txt && echo c > c.txt")
	if err != nil || out != "b\n" {
		t.Fatalf("exec: %q %v", out, err)
	}
	assertTree(t, local, map[string]string{"a.txt": "-rw-r--r--:a\n", "b.txt": "-rw-r--r--:b\n", "c.txt": "-rw-r--r--:c\n"})
}

// A base commit the sandbox lacks is pushed to it.
func TestSandboxMissingBaseCommitIsPushed(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	writeFile(t, filepath.Join(f.local, "b.txt"), "b\n")
	testutil.Git(t, f.local, "add", "b.txt")
	testutil.Git(t, f.local, "commit", "-q", "-m", "not pushed")
	f.base = strings.TrimSpace(testutil.Git(t, f.local, "rev-parse", "HEAD"))
	p, err := f.s.Prepare(context.Background(), f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	res, err := f.s.Push(context.Background(), f.r, p)
	if err != nil || !res.Commits {
		t.Fatalf("push: %+v %v", res, err)
	}
	assertTree(t, f.sandbox, map[string]string{"a.txt": "-rw-r--r--:a\n", "b.txt": "-rw-r--r--:b\n"})
}

// The base is only where the sandbox started: a local repository without it
// still syncs (its HEAD is pushed); a branch name is not a base.
func TestLocalBaseUnknown(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	if _, err := f.s.Prepare(context.Background(), f.local, strings.Repeat("ab", 20)); err != nil {
		t.Fatalf("err = %v", err)
	}
	if _, err := f.s.Prepare(context.Background(), f.local, "main"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("a branch name as base: %v", err)
	}
}

func TestEmptyRepository(t *testing.T) {
	isolate(t)
	dir := filepath.Join(t.TempDir(), "empty")
	testutil.Git(t, filepath.Dir(dir), "init", "-q", dir)
	writeFile(t, filepath.Join(dir, "a.txt"), "a\n")
	_, err := New(Options{}).Prepare(context.Background(), dir, "")
	if !errors.Is(err, ErrEmptyRepository) || !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "git commit") {
		t.Fatalf("err = %v", err)
	}
}

func TestNotAGitRepository(t *testing.T) {
	isolate(t)
	dir := t.TempDir()
	_, err := New(Options{}).Prepare(context.Background(), dir, strings.Repeat("a", 40))
	if !errors.Is(err, ErrNotGitRepository) || !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("err = %v", err)
	}
	// Pull refuses before touching the sandbox.
	r := &sandboxRunner{dir: dir}
	if _, err := New(Options{}).Pull(context.Background(), r, dir); !errors.Is(err, ErrNotGitRepository) || r.calls() != 0 {
		t.Fatalf("pull: %v, %d calls", err, r.calls())
	}
}

func TestSandboxWithoutGitDir(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	if err := os.RemoveAll(filepath.Join(f.sandbox, ".git")); err != nil {
		t.Fatal(err)
	}
	p, err := f.s.Prepare(context.Background(), f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.s.Push(context.Background(), f.r, p); !errors.Is(err, ErrNoGitDir) || !errors.Is(err, errdefs.ErrGone) {
		t.Fatalf("push: %v", err)
	}
	if _, err := f.s.Pull(context.Background(), f.r, f.local); !errors.Is(err, ErrNoGitDir) {
		t.Fatalf("pull: %v", err)
	}
	if err := f.s.Revert(context.Background(), f.r); !errors.Is(err, ErrNoGitDir) {
		t.Fatalf("revert: %v", err)
	}
}

func TestPatchTooLarge(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	f.s = New(Options{MaxPatchBytes: 4 << 10})
	writeFile(t, filepath.Join(f.local, "big.bin"), randomBytes(20<<10, 9))
	writeFile(t, filepath.Join(f.local, "small.txt"), "small\n")
	_, err := f.s.Prepare(context.Background(), f.local, f.base)
	if !errors.Is(err, ErrPatchTooLarge) || !errors.Is(err, errdefs.ErrTooLarge) ||
		!strings.Contains(err.Error(), "4.0 KiB limit") || !strings.Contains(err.Error(), "big.bin (20.0 KiB)") {
		t.Fatalf("err = %v", err)
	}

	// The sandbox making a patch over the limit: not applied, saved
	// locally (streamed, whatever its size) and its path stated; the next
	// exec does not bring it back again.
	if err := os.Remove(filepath.Join(f.local, "big.bin")); err != nil {
		t.Fatal(err)
	}
	want := tree(t, f.local)
	f.push()
	f.inSandbox("head -c 30000 /dev/urandom > huge.bin")
	res, err := f.s.Pull(context.Background(), f.r, f.local)
	if !errors.Is(err, ErrPatchTooLarge) || res.SavedPatch == "" || !strings.Contains(err.Error(), res.SavedPatch) {
		t.Fatalf("pull err = %v (saved %q)", err, res.SavedPatch)
	}
	if !strings.HasPrefix(res.SavedPatch, filepath.Join(f.local, ".git", "sandboxd", "pulls")) || !bytes.Contains(fileBytes(t, res.SavedPatch), []byte("huge.bin")) {
		t.Fatalf("saved patch %s", res.SavedPatch)
	}
	assertTree(t, f.local, want)
	f.pushAndCompare()
}

// Ignored files are neither pushed nor pulled, and the sandbox's ignored
// files (build caches) survive the revert.
func TestIgnoredFiles(t *testing.T) {
	f := newFixture(t, map[string]string{".gitignore": "*.log\ncache/\n", "a.txt": "a\n"})
	writeFile(t, filepath.Join(f.local, "debug.log"), "local log\n")
	writeFile(t, filepath.Join(f.local, "cache/c"), "local cache\n")
	want := tree(t, f.local)
	p := f.push()
	if strings.Contains(string(p.Data), "debug.log") || len(p.Data) != 0 {
		t.Fatalf("ignored files in the patch:\n%s", p.Data)
	}
	f.inSandbox("echo sandbox > build.log && mkdir -p cache && echo warm > cache/c")
	res, err := f.pull()
	if err != nil || len(res.Files) != 0 {
		t.Fatalf("pull: %v %v", res.Files, err)
	}
	assertTree(t, f.local, want)
	if got := string(fileBytes(t, filepath.Join(f.sandbox, "cache/c"))); got != "warm\n" {
		t.Fatalf("the sandbox's cache was removed: %q", got)
	}
}

// Prepare leaves the user's index and working tree byte for byte as they
// were, with staged, unstaged and untracked changes mixed.
func TestPrepareTouchesNothing(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n", "b.txt": "b\n", "c.txt": "c\n"})
	writeFile(t, filepath.Join(f.local, "a.txt"), "a staged\n")
	testutil.Git(t, f.local, "add", "a.txt")
	writeFile(t, filepath.Join(f.local, "a.txt"), "a staged then edited\n")
	writeFile(t, filepath.Join(f.local, "untracked.txt"), "u\n")
	testutil.Git(t, f.local, "rm", "-q", "--cached", "b.txt")
	if err := os.Remove(filepath.Join(f.local, "c.txt")); err != nil {
		t.Fatal(err)
	}
	wantTree := tree(t, f.local)
	indexPath := filepath.Join(f.local, ".git", "index")
	status := testutil.Git(t, f.local, "status", "--porcelain") // may refresh the index: read it after
	wantIndex := fileBytes(t, indexPath)
	st, _ := os.Stat(indexPath)

	p, err := f.s.Prepare(context.Background(), f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(p.Files, ",") != "a.txt,c.txt,untracked.txt" {
		t.Fatalf("patch files %v", p.Files)
	}
	assertTree(t, f.local, wantTree)
	if !bytes.Equal(wantIndex, fileBytes(t, indexPath)) {
		t.Fatal("Prepare changed the index")
	}
	if st2, _ := os.Stat(indexPath); st != nil && st2.ModTime().Before(st.ModTime()) {
		t.Fatal("index time went back")
	}
	if got := testutil.Git(t, f.local, "status", "--porcelain"); got != status {
		t.Fatalf("status changed:\n%s\nwas:\n%s", got, status)
	}
	if left, _ := filepath.Glob(filepath.Join(f.local, ".git", "sandboxd", "index-*")); len(left) != 0 {
		t.Fatalf("temporary index left behind: %v", left)
	}
	// The sandbox gets the working tree (b.txt is untracked but present).
	if _, err := f.s.Push(context.Background(), f.r, p); err != nil {
		t.Fatal(err)
	}
	assertTree(t, f.sandbox, wantTree)
}

// A pull whose output breaks in transit is fetched again from the copy the
// sandbox keeps (one extra, idempotent call) and nothing is lost.
func TestPullTransferBrokenRecovers(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	f.push()
	f.inSandbox("echo changed > a.txt && head -c 5000 /dev/urandom > r.bin")
	want := tree(t, f.sandbox)
	f.r.reset()
	r := &truncatingRunner{sandboxRunner: f.r, cut: 100}
	res, err := f.s.Pull(context.Background(), r, f.local)
	if err != nil {
		t.Fatal(err)
	}
	assertTree(t, f.local, want)
	if strings.Join(res.Files, ",") != "a.txt,r.bin" || r.calls() != 2 {
		t.Fatalf("pulled %v in %d calls", res.Files, r.calls())
	}
	assertTree(t, f.sandbox, want)
}

// truncatingRunner cuts the first command's stdout after cut bytes and
// reports a broken connection, as a dropped SSH channel would.
type truncatingRunner struct {
	*sandboxRunner
	cut  int
	done bool
}

func (r *truncatingRunner) Run(ctx context.Context, command string, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	if r.done {
		return r.sandboxRunner.Run(ctx, command, stdin, stdout, stderr)
	}
	r.done = true
	var buf bytes.Buffer
	code, err := r.sandboxRunner.Run(ctx, command, stdin, &buf, stderr)
	if err != nil {
		return code, err
	}
	_, _ = stdout.Write(buf.Bytes()[:min(r.cut, buf.Len())])
	return -1, errors.New("connection lost")
}

func TestRevertAlone(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	f.push()
	f.inSandbox("echo x > a.txt && echo y > y.txt")
	f.r.reset()
	if err := f.s.Revert(context.Background(), f.r); err != nil {
		t.Fatal(err)
	}
	if f.r.calls() != 1 {
		t.Fatalf("revert made %d calls", f.r.calls())
	}
	f.assertSandboxClean()
	assertTree(t, f.sandbox, map[string]string{"a.txt": "-rw-r--r--:a\n"})
	// A pull now finds nothing: a stray pull never reverses local work.
	writeFile(t, filepath.Join(f.local, "local.txt"), "mine\n")
	want := tree(t, f.local)
	if res, err := f.pull(); err != nil || len(res.Files) != 0 {
		t.Fatalf("pull after revert: %v %v", res.Files, err)
	}
	assertTree(t, f.local, want)
}

func TestPullWithoutSnapshot(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	_, err := f.s.Pull(context.Background(), f.r, f.local)
	if !errors.Is(err, ErrNoSnapshot) {
		t.Fatalf("err = %v", err)
	}
}

// Two execs in a row with no changes anywhere cost one call each way and
// move nothing.
func TestNoChanges(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	want := tree(t, f.local)
	for i := 0; i < 2; i++ {
		out, res, err := f.exec("cat a.txt")
		if err != nil || out != "a\n" || len(res.Files) != 0 {
			t.Fatalf("exec %d: %q %v %v", i, out, res.Files, err)
		}
	}
	assertTree(t, f.local, want)
}

func TestSyncFromSubdirectoryPath(t *testing.T) {
	f := newFixture(t, map[string]string{"sub/a.txt": "a\n"})
	writeFile(t, filepath.Join(f.local, "sub/b.txt"), "b\n")
	p, err := f.s.Prepare(context.Background(), filepath.Join(f.local, "sub"), f.base)
	if err != nil {
		t.Fatal(err)
	}
	if p.RepoRoot != f.local || strings.Join(p.Files, ",") != "sub/b.txt" {
		t.Fatalf("root %s files %v", p.RepoRoot, p.Files)
	}
}

// The sandbox deletes a file the user edits during the exec, and creates one
// the user creates too: the user's versions stay, the sandbox's are in the
// saved patch.
func TestConflictDeleteAndCreate(t *testing.T) {
	f := newFixture(t, map[string]string{"gone.txt": "v1\n", "other.txt": "o\n"})
	f.push()
	f.inSandbox("rm gone.txt && echo sandbox > both.txt && echo sandbox > other.txt")
	writeFile(t, filepath.Join(f.local, "gone.txt"), "v2 edited during the exec\n")
	writeFile(t, filepath.Join(f.local, "both.txt"), "local\n")
	res, err := f.pull()
	var ce *ConflictError
	if !errors.As(err, &ce) {
		t.Fatalf("want a conflict, got %v", err)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "gone.txt"))); !strings.Contains(got, "v2 edited during the exec") {
		t.Fatalf("the local edit was lost: %q", got)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "both.txt"))); !strings.Contains(got, "local\n") {
		t.Fatalf("the local file was lost: %q", got)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "other.txt"))); got != "sandbox\n" {
		t.Fatalf("the change that applies was not applied: %q", got)
	}
	saved := string(fileBytes(t, res.SavedPatch))
	if !strings.Contains(saved, "deleted file mode") || !strings.Contains(saved, "+sandbox") {
		t.Fatalf("saved patch:\n%s", saved)
	}
	t.Logf("conflict reported as: %v", err)
}

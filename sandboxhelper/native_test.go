//go:build linux

package sandboxhelper

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/internal/gitobj"
)

// nativeFixture is a checkout at one commit, with a nativeState whose
// tracker answers what the test says (told).
type nativeFixture struct {
	root, head string
	n          *nativeState
	told       []string
	full       bool
}

func newNativeFixture(t *testing.T, files map[string]string) *nativeFixture {
	t.Helper()
	isolate(t)
	root := t.TempDir()
	run(t, root, nil, "init", "-q")
	for p, c := range files {
		write(t, filepath.Join(root, p), c)
	}
	run(t, root, nil, "add", "-A")
	run(t, root, nil, "commit", "-qm", "base")
	f := &nativeFixture{root: root, head: run(t, root, nil, "rev-parse", "HEAD")}
	state := filepath.Join(root, ".git", "sandboxd")
	if err := os.MkdirAll(state, 0o755); err != nil {
		t.Fatal(err)
	}
	f.n = &nativeState{root: root, gitDir: filepath.Join(root, ".git"), state: state,
		changes: func(context.Context) ([]string, []string, bool) {
			told := f.told
			f.told = nil
			return told, nil, f.full
		}}
	t.Cleanup(f.n.close)
	if err := f.n.adopt(run(t, root, nil, "rev-parse", "HEAD^{tree}")); err != nil {
		t.Fatal(err)
	}
	return f
}

func (f *nativeFixture) push(entries ...PushEntry) (string, error) {
	_, tree, err := f.n.push(context.Background(), pushRequest{Head: f.head, Entries: entries, Time: 1, SnapRef: "refs/sandboxd/sync", BaseRef: "refs/sandboxd/base"})
	return tree, err
}

func blobEntry(p, content string) PushEntry {
	return PushEntry{Path: p, Mode: gitobj.ModeFile, OID: gitobj.HashObject("blob", []byte(content)).String(), Data: []byte(content)}
}

// The daemon's paths are checked before anything is written: none leads
// out of the checkout or into .git.
func TestNativePushRefusesHostilePaths(t *testing.T) {
	for _, p := range []string{"../x", "/tmp/x", ".git/hooks/pre-commit", "a/../../x", "a/.GIT/config", "a//b", "a/", "."} {
		t.Run(p, func(t *testing.T) {
			f := newNativeFixture(t, map[string]string{"a.txt": "a\n"})
			_, err := f.push(blobEntry(p, "evil\n"))
			if !errors.Is(err, errDecline) {
				t.Fatalf("push of %q: %v, want a decline", p, err)
			}
			if _, err := os.Lstat(filepath.Join(f.root, ".git", "hooks", "pre-commit")); err == nil {
				t.Fatal("a hook was written")
			}
		})
	}
}

// Content that is not the blob it claims to be is refused.
func TestNativePushRefusesContentThatIsNotItsBlob(t *testing.T) {
	f := newNativeFixture(t, map[string]string{"a.txt": "a\n"})
	e := blobEntry("a.txt", "one\n")
	e.Data = []byte("two\n")
	if _, err := f.push(e); !errors.Is(err, errDecline) {
		t.Fatalf("push: %v, want a decline", err)
	}
	if got := readFile(t, filepath.Join(f.root, "a.txt")); got != "a\n" {
		t.Fatalf("a.txt is %q", got)
	}
}

// A push writes nothing through a symbolic link the working tree holds
// where a directory was: it declines (the plain way puts the directory
// back).
func TestNativePushDoesNotWriteThroughASymlink(t *testing.T) {
	f := newNativeFixture(t, map[string]string{"dir/c.txt": "c\n"})
	outside := t.TempDir()
	write(t, filepath.Join(outside, "c.txt"), "outside\n")
	if err := os.RemoveAll(filepath.Join(f.root, "dir")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(f.root, "dir")); err != nil {
		t.Fatal(err)
	}
	f.told = []string{"dir/c.txt"} // what a tracker that missed the link would say
	if _, err := f.push(blobEntry("dir/c.txt", "changed\n")); !errors.Is(err, errDecline) {
		t.Fatalf("push: %v, want a decline", err)
	}
	if got := readFile(t, filepath.Join(outside, "c.txt")); got != "outside\n" {
		t.Fatalf("the push wrote through the link: %q", got)
	}
	if f.n.valid {
		t.Fatal("the base is still trusted after a decline past the tracker's answer")
	}
}

// A pull reads nothing through a symbolic link: a file the tracker names
// under a directory that is now a link is gone, as git sees it.
func TestNativePullDoesNotReadThroughASymlink(t *testing.T) {
	f := newNativeFixture(t, map[string]string{"a.txt": "a\n"})
	tree, err := f.push()
	if err != nil {
		t.Fatal(err)
	}
	outside := t.TempDir()
	write(t, filepath.Join(outside, "c.txt"), "outside\n")
	if err := os.Symlink(outside, filepath.Join(f.root, "dir")); err != nil {
		t.Fatal(err)
	}
	f.told = []string{"dir", "dir/c.txt"}
	out := filepath.Join(t.TempDir(), "pull.patch")
	if err := f.n.pull(context.Background(), pullRequest{Tree: tree, Out: out, DiffArgs: []string{"--binary", "--full-index", "--no-renames"}}); err != nil {
		t.Fatal(err)
	}
	patch := readFile(t, out)
	if strings.Contains(patch, "dir/c.txt") {
		t.Fatalf("the pull read through the link:\n%s", patch)
	}
	if !strings.Contains(patch, "new file mode 120000") {
		t.Fatalf("the link is not in the pull:\n%s", patch)
	}
}

// When the tracker cannot tell what changed, the native sync declines and
// forgets its base, so that the plain way's full scan sets things right.
func TestNativeDeclinesWhenTheTrackerCannotTell(t *testing.T) {
	f := newNativeFixture(t, map[string]string{"a.txt": "a\n"})
	f.full = true
	if _, err := f.push(blobEntry("a.txt", "one\n")); !errors.Is(err, errDecline) {
		t.Fatalf("push: %v, want a decline", err)
	}
	if f.n.valid {
		t.Fatal("the base is still trusted")
	}
	if got := readFile(t, filepath.Join(f.root, "a.txt")); got != "a\n" {
		t.Fatalf("a.txt is %q", got)
	}
}

// An untracked file the command left is removed by the next push unless
// git ignores it (a build's output stays).
func TestNativePushKeepsIgnoredFiles(t *testing.T) {
	f := newNativeFixture(t, map[string]string{".gitignore": "*.o\n", "a.txt": "a\n"})
	write(t, filepath.Join(f.root, "x.o"), "object\n")
	write(t, filepath.Join(f.root, "stray.txt"), "stray\n")
	f.told = []string{"x.o", "stray.txt"}
	if _, err := f.push(blobEntry("a.txt", "one\n")); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, filepath.Join(f.root, "x.o")); got != "object\n" {
		t.Fatalf("x.o is %q", got)
	}
	if _, err := os.Lstat(filepath.Join(f.root, "stray.txt")); !os.IsNotExist(err) {
		t.Fatalf("stray.txt is still there: %v", err)
	}
	if got := readFile(t, filepath.Join(f.root, "a.txt")); got != "one\n" {
		t.Fatalf("a.txt is %q", got)
	}
}

func readFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// Attributes that convert nothing leave the native sync on; any that can
// make a file differ from its blob, or a macro, turn it off.
func TestConvertingAttribute(t *testing.T) {
	for text, want := range map[string]string{
		"":                                    "",
		"# text\n*.png binary\n":              "",
		"*.go diff=golang linguist-generated": "",
		"*.sh -text\n*.bat -crlf !eol\n":      "",
		"* text=auto\n":                       "text=auto",
		"*.txt eol=crlf":                      "eol=crlf",
		"*.bin filter=lfs diff=lfs -text":     "filter=lfs",
		"*.c ident":                           "ident",
		"*.txt working-tree-encoding=UTF-16":  "working-tree-encoding=UTF-16",
		"*.txt crlf":                          "crlf",
		"[attr]mine text\n*.x mine":           "a macro",
		`"a text" diff`:                       "",
		`"a \" text" eol=lf`:                  "eol=lf",
	} {
		if got := ConvertingAttribute([]byte(text)); got != want {
			t.Errorf("%q: %q, want %q", text, got, want)
		}
	}
}

package repocheck

import (
	"bytes"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// maxTracked bounds a tracked file's size: the largest source file is far
// below it, and an output checked in by mistake (a binary, a bench
// result, a package) is over it.
const maxTracked = 1 << 20

// git runs git in the repository with an isolated HOME and XDG_CONFIG_HOME
// (so the user's own settings, excludes included, play no part) and
// returns its stdout.
func git(t *testing.T, root string, args ...string) []byte {
	t.Helper()
	cmd := exec.Command("git", append([]string{"-C", root}, args...)...)
	home := t.TempDir()
	cmd.Env = append(os.Environ(), "HOME="+home, "XDG_CONFIG_HOME="+filepath.Join(home, ".config"), "GIT_CONFIG_NOSYSTEM=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, stderr.Bytes())
	}
	return out
}

// repoRoot is the repository's root, two levels up, in a git checkout;
// without git or a checkout (a source tarball) there is nothing to check,
// except under CI, where .ci/run installs git and runs in a clone.
func repoRoot(t *testing.T) string {
	t.Helper()
	skip := func(format string, args ...any) {
		t.Helper()
		if os.Getenv("CI") == "true" {
			t.Fatalf(format+", and CI=true", args...)
		}
		t.Skipf(format, args...)
	}
	if _, err := exec.LookPath("git"); err != nil {
		skip("git is not installed")
	}
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if err := exec.Command("git", "-C", root, "rev-parse", "--is-inside-work-tree").Run(); err != nil {
		skip("%s is not in a git checkout: %v", root, err)
	}
	return root
}

// binaryMagic are the first bytes of the executables and objects Go
// builds: ELF, Mach-O (32 and 64 bits, both byte orders, universal), PE.
var binaryMagic = [][]byte{
	[]byte("\x7fELF"),
	{0xfe, 0xed, 0xfa, 0xce}, {0xce, 0xfa, 0xed, 0xfe},
	{0xfe, 0xed, 0xfa, 0xcf}, {0xcf, 0xfa, 0xed, 0xfe},
	{0xca, 0xfe, 0xba, 0xbe},
	[]byte("MZ"),
}

// binaryReason says why a file's content is not source text, or "".
func binaryReason(b []byte) string {
	for _, m := range binaryMagic {
		if bytes.HasPrefix(b, m) {
			return "starts like an executable"
		}
	}
	if bytes.IndexByte(b, 0) >= 0 {
		return "holds NUL bytes"
	}
	if len(b) > maxTracked {
		return "is over 1 MiB"
	}
	return ""
}

// TestGitTracksNoBinary reads every file git tracks: none is an executable,
// holds NUL bytes (git's own test for binary content) or is over 1 MiB.
// Build outputs belong under bin/ and dist/, which git ignores.
func TestGitTracksNoBinary(t *testing.T) {
	root := repoRoot(t)
	files := strings.Split(strings.TrimSuffix(string(git(t, root, "ls-files", "-z")), "\x00"), "\x00")
	if len(files) < 10 {
		t.Fatalf("git ls-files lists %d files", len(files))
	}
	for _, f := range files {
		path := filepath.Join(root, f)
		fi, err := os.Lstat(path)
		if err != nil {
			if os.IsNotExist(err) {
				continue // deleted in the working tree, not yet in the index
			}
			t.Fatal(err)
		}
		if !fi.Mode().IsRegular() {
			continue
		}
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if why := binaryReason(b); why != "" {
			t.Errorf("git tracks %s, which %s (%d bytes): git rm --cached it and build into bin/", f, why, len(b))
		}
	}
}

// TestBinaryReasonTellsSourceFromBinaries checks the check: the test's
// own source passes, an ELF header, a Mach-O header and a NUL byte do not.
func TestBinaryReasonTellsSourceFromBinaries(t *testing.T) {
	src, err := os.ReadFile("repocheck_test.go")
	if err != nil {
		t.Fatal(err)
	}
	if why := binaryReason(src); why != "" {
		t.Errorf("this source file %s", why)
	}
	for _, b := range [][]byte{[]byte("\x7fELF\x02\x01\x01"), {0xcf, 0xfa, 0xed, 0xfe, 7}, []byte("text\x00more"), make([]byte, maxTracked+1)} {
		if binaryReason(b) == "" {
			t.Errorf("%q... passes for text", b[:min(len(b), 8)])
		}
	}
}

// mainPackages are the directories, relative to root, of the repository's
// commands (package main, outside testdata).
func mainPackages(t *testing.T, root string) []string {
	t.Helper()
	dirs := map[string]bool{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if n := d.Name(); p != root && (strings.HasPrefix(n, ".") || n == "testdata" || n == "bin" || n == "dist" || n == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), p, nil, parser.PackageClauseOnly)
		if err != nil {
			return err
		}
		if f.Name.Name == "main" {
			rel, _ := filepath.Rel(root, filepath.Dir(p))
			dirs[filepath.ToSlash(rel)] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for d := range dirs {
		out = append(out, d)
	}
	return out
}

// TestGitIgnoresEveryBuildOutput checks .gitignore against what the build
// commands write: `go build ./cmd/NAME` at the root writes NAME there,
// `go build` in a command's directory writes NAME in it, `go test -c`
// writes NAME.test, make writes bin/ and dist/. No tracked file is ignored
// (a pattern that hid source would hide its changes too).
func TestGitIgnoresEveryBuildOutput(t *testing.T) {
	root := repoRoot(t)
	cmds := mainPackages(t, root)
	if len(cmds) < 5 {
		t.Fatalf("found %d commands (package main): %v", len(cmds), cmds)
	}
	paths := []string{"bin/sandboxd", "bin/share/man/man1/sandboxd.1", "dist/sandboxd_1.0.0_amd64.deb", "daemon.test", "daemon/gitsync/gitsync.test", "cover.out"}
	for _, d := range cmds {
		name := filepath.Base(d)
		paths = append(paths, name, d+"/"+name)
	}
	for _, p := range paths {
		cmd := exec.Command("git", "-C", root, "check-ignore", "--no-index", "-q", p)
		cmd.Env = append(os.Environ(), "HOME="+t.TempDir(), "GIT_CONFIG_NOSYSTEM=1")
		if err := cmd.Run(); err != nil {
			if ee, ok := err.(*exec.ExitError); ok && ee.ExitCode() == 1 {
				t.Errorf(".gitignore does not ignore %s, a build output: add /%s", p, p)
				continue
			}
			t.Fatalf("git check-ignore %s: %v", p, err)
		}
	}
	if hidden := strings.TrimSpace(string(git(t, root, "ls-files", "-c", "-i", "--exclude-standard"))); hidden != "" {
		t.Errorf(".gitignore matches tracked files:\n%s", hidden)
	}
}

// TestReadmeIsAManual keeps the README a manual: at most 250 lines, the two
// commands first, and the measurements and guarantees on pages of their
// own that it links (they once made up most of it).
func TestReadmeIsAManual(t *testing.T) {
	root := repoRoot(t)
	b, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	if n := strings.Count(readme, "\n"); n > 250 {
		t.Errorf("the README has %d lines, over 250: move reference material to docs/", n)
	}
	first := readme[strings.Index(readme, "```"):]
	first = first[:strings.Index(first[3:], "```")+3]
	for _, cmd := range []string{"make run", "make test"} {
		if !strings.Contains(first, "\n"+cmd+" ") {
			t.Errorf("the README's first code block lacks %q:\n%s", cmd, first)
		}
	}
	for _, page := range []string{"docs/guarantees.md", "docs/performance.md"} {
		if !strings.Contains(readme, "]("+page+")") {
			t.Errorf("the README does not link %s", page)
		}
		if _, err := os.Stat(filepath.Join(root, page)); err != nil {
			t.Errorf("%s: %v", page, err)
		}
	}
}

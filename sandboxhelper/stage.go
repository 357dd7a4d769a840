package sandboxhelper

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
)

// StageOptions say what Stage does.
type StageOptions struct {
	Root     string // the checkout (absolute)
	State    string // the sync state directory, .git/sandboxd (absolute)
	Instance string // the server to ask
	Index    string // the sync index to stage into (absolute)
	// PrintTree prints the index's tree after staging.
	PrintTree bool
	// Head and Real: the user's index Real is reset to commit Head, unless
	// it is still as this helper left it for Head.
	Head, Real string
}

// Result says what Stage did.
type Result struct {
	Full   bool   // the whole tree was staged
	Staged int    // paths handed to git add (restricted staging)
	Tree   string // with PrintTree
}

// errFallback: the restricted staging does not apply; stage everything.
var errFallback = errors.New("stage the whole tree")

// Stage brings the sync index up to date with the working tree, as `git
// add -A` would: only the paths the server saw change when it can vouch
// for every other path, the whole tree otherwise.
//
// The marker <index>.fast holds the server instance whose answers the index
// is up to date with. It is removed before anything is asked and written
// back only once the index is staged, so an exit at any point (or a script
// that rewrote the index its own way and removed it) makes the next stage
// look at the whole tree.
func Stage(ctx context.Context, o StageOptions) (Result, error) {
	var res Result
	marker := o.Index + ".fast"
	prev, _ := os.ReadFile(marker)
	if _, err := os.Stat(o.Index); err != nil {
		// No index to be up to date: whatever the marker says.
		prev = nil
	}
	if err := os.Remove(marker); err != nil && !errors.Is(err, os.ErrNotExist) {
		return res, fmt.Errorf("remove %s: %w", marker, err)
	}
	a, qerr := query(ctx, o.State, o.Instance)
	staged := false
	err := errFallback
	if qerr == nil && !a.Full && strings.TrimSpace(string(prev)) == o.Instance {
		res.Staged, err = stageRestricted(ctx, o, append(a.Paths, a.Gone...))
		staged = res.Staged > 0
	}
	if err != nil {
		res.Full, staged = true, true
		if _, err := git(ctx, o.Root, o.Index, nil, "add", "-A"); err != nil {
			return res, err
		}
	}
	if qerr == nil {
		// A full answer re-based the server at this question, before the
		// scan: the index is up to date with its answers from now on.
		if err := os.WriteFile(marker, []byte(o.Instance+"\n"), 0o644); err != nil {
			return res, fmt.Errorf("write %s: %w", marker, err)
		}
	}
	cache := o.Index + ".tree"
	if o.PrintTree {
		t, ok := cachedTree(cache, o.Index)
		if !ok || staged {
			out, err := git(ctx, o.Root, o.Index, nil, "write-tree")
			if err != nil {
				return res, err
			}
			t = strings.TrimSpace(string(out))
			// write-tree may rewrite the index (its cache of trees), so
			// the stamp is taken after.
			rememberTree(cache, o.Index, t)
		}
		res.Tree = t
	}
	if o.Head != "" && o.Real != "" {
		if err := resetReal(ctx, o); err != nil {
			return res, err
		}
	}
	return res, nil
}

// stageRestricted stages paths (and everything under the directories among
// them): git status names those that differ from the sync index, as git add
// -A would see them, and git add takes exactly those. It returns how many
// were handed to git add.
func stageRestricted(ctx context.Context, o StageOptions, paths []string) (int, error) {
	// The tracker leaves nested repositories out, so a submodule whose
	// checkout moved is not among the paths: with submodules, git looks.
	if _, err := os.Lstat(filepath.Join(o.Root, ".gitmodules")); err == nil {
		return 0, errFallback
	}
	if len(paths) == 0 {
		return 0, nil
	}
	for _, p := range paths {
		// Rules that decide what the other paths are.
		switch path.Base(p) {
		case ".gitignore", ".gitattributes", ".gitmodules":
			return 0, errFallback
		}
	}
	// A build writing thousands of files (often in an ignored directory)
	// is named by the directories it wrote in: git status does not go
	// into an ignored one.
	paths = collapse(paths, maxPaths)
	size := 0
	for _, p := range paths {
		size += len(p) + 1
	}
	if paths == nil || size > maxPathBytes {
		return 0, errFallback
	}
	args := append([]string{"--no-optional-locks", "status", "--porcelain=v1", "-z", "--untracked-files=all", "--no-renames", "--ignore-submodules=none", "--"}, paths...)
	out, err := git(ctx, o.Root, o.Index, nil, args...)
	if err != nil {
		return 0, errFallback
	}
	var add bytes.Buffer
	n := 0
	for _, rec := range bytes.Split(out, []byte{0}) {
		if len(rec) < 4 || rec[2] != ' ' {
			continue
		}
		x, y := rec[0], rec[1]
		if (x == '?' && y == '?') || y != ' ' {
			add.Write(rec[3:])
			add.WriteByte(0)
			n++
		}
	}
	if n == 0 {
		return 0, nil
	}
	if _, err := git(ctx, o.Root, o.Index, &add, "add", "-A", "--pathspec-from-file=-", "--pathspec-file-nul"); err != nil {
		// A path that went away since git status looked, say: the whole
		// tree is staged instead.
		return 0, errFallback
	}
	return n, nil
}

// treeCache is <index>.tree: the index's tree as of one version of the
// index file.
type treeCache struct {
	Stamp stamp  `json:"stamp"`
	Tree  string `json:"tree"`
}

func rememberTree(cache, index, tree string) {
	st, ok := stampOf(index)
	if !ok {
		_ = os.Remove(cache)
		return
	}
	b, _ := json.Marshal(treeCache{Stamp: st, Tree: tree})
	writeAtomic(cache, b)
}

func cachedTree(cache, index string) (string, bool) {
	var c treeCache
	b, err := os.ReadFile(cache)
	if err != nil || json.Unmarshal(b, &c) != nil || c.Tree == "" {
		return "", false
	}
	st, ok := stampOf(index)
	return c.Tree, ok && st == c.Stamp
}

// realState is <state>/real.json: the user's index as this helper last
// reset it to a commit.
type realState struct {
	Head  string `json:"head"`
	Stamp stamp  `json:"stamp"`
}

// resetReal resets the user's index to o.Head (git read-tree), unless the
// file is still the version this helper wrote for that commit.
func resetReal(ctx context.Context, o StageOptions) error {
	file := o.State + "/real.json"
	var r realState
	if b, err := os.ReadFile(file); err == nil && json.Unmarshal(b, &r) == nil && r.Head == o.Head {
		if st, ok := stampOf(o.Real); ok && st == r.Stamp {
			return nil
		}
	}
	_ = os.Remove(file)
	if _, err := git(ctx, o.Root, o.Real, nil, "read-tree", o.Head); err != nil {
		return err
	}
	if st, ok := stampOf(o.Real); ok {
		b, _ := json.Marshal(realState{Head: o.Head, Stamp: st})
		writeAtomic(file, b)
	}
	return nil
}

// writeAtomic writes a cache file by a rename, so that a reader never sees
// half of it; a cache that cannot be written is only a cache.
func writeAtomic(name string, b []byte) {
	tmp := name + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return
	}
	if err := os.Rename(tmp, name); err != nil {
		_ = os.Remove(tmp)
	}
}

// git runs git in root on index, as the sync scripts do, pathspecs
// literal.
func git(ctx context.Context, root, index string, stdin io.Reader, args ...string) ([]byte, error) {
	return runGit(ctx, root, []string{"GIT_INDEX_FILE=" + index, "GIT_LITERAL_PATHSPECS=1"}, stdin, args...)
}

// runGit runs git in root with env added to the helper's: any checkout
// owner trusted, no repository hook.
func runGit(ctx context.Context, root string, env []string, stdin io.Reader, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, "git", append([]string{"-c", "safe.directory=*", "-c", "core.hooksPath=/dev/null"}, args...)...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdin = stdin
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("git %s: %w: %s", subcommand(args), err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// subcommand is the git command args run, past the options before it.
func subcommand(args []string) string {
	for _, a := range args {
		if !strings.HasPrefix(a, "-") {
			return a
		}
	}
	return strings.Join(args, " ")
}

// collapse returns at most limit pathspecs covering paths: the paths
// themselves, or, when there are more, their ancestor directories at the
// greatest depth that brings them under limit (a directory's literal
// pathspec covers everything under it). nil when even the top-level
// entries are more than limit.
func collapse(paths []string, limit int) []string {
	if len(paths) <= limit {
		return paths
	}
	depth := 0
	for _, p := range paths {
		depth = max(depth, strings.Count(p, "/")+1)
	}
	for d := depth - 1; d >= 1; d-- {
		seen := map[string]bool{}
		var out []string
		for _, p := range paths {
			if i := nthSlash(p, d); i >= 0 {
				p = p[:i]
			}
			if !seen[p] {
				seen[p] = true
				out = append(out, p)
			}
		}
		if len(out) <= limit {
			return out
		}
	}
	return nil
}

// nthSlash is the index of the n-th "/" of p, -1 when it has fewer.
func nthSlash(p string, n int) int {
	for i := range len(p) {
		if p[i] == '/' {
			n--
			if n == 0 {
				return i
			}
		}
	}
	return -1
}

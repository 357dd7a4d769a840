package watch

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/sandboxd/sandboxd/errdefs"
)

// DetachedPrefix starts the branch name of a detached HEAD, followed by the
// commit's short sha: the RWX CLI's naming (GetCurrentGitBranch).
const DetachedPrefix = "detached@"

// shortSHALen is the length of the short sha of a detached HEAD. The RWX CLI
// takes `git rev-parse --short HEAD`, which is 7 characters unless the
// repository is very large or the prefix is ambiguous.
const shortSHALen = 7

// Branches caches the current branch of repositories, read from the HEAD
// file without running git and refreshed when HEAD changes on disk. After
// the first call for a repository, Branch is a map read plus one stat of
// HEAD: the watcher's notice arrives a moment after the change, and a
// caller that switched branches and runs nook at once must not be answered
// with the old branch.
type Branches struct {
	w        *Watcher
	onChange func(repoRoot, oldBranch, newBranch string)
	reads    atomic.Uint64

	mu    sync.RWMutex
	repos map[string]*repoHead
}

type repoHead struct {
	loaded chan struct{} // closed once the first read is done
	head   string        // path of the HEAD file
	err    error         // the first read's error; set before loaded closes
	branch string        // guarded by Branches.mu
	stamp  fileStamp     // HEAD's identity when branch was read; guarded by Branches.mu
	cancel func()        // removes the HEAD watch
}

// fileStamp identifies one version of a file: git replaces HEAD through a
// lock file and a rename, so any change gives a new inode or mtime.
type fileStamp struct {
	ino   uint64
	size  int64
	mtime int64
}

func stampOf(path string) (fileStamp, error) {
	info, err := os.Stat(path)
	if err != nil {
		return fileStamp{}, err
	}
	st := fileStamp{size: info.Size(), mtime: info.ModTime().UnixNano()}
	if sys, ok := info.Sys().(*syscall.Stat_t); ok {
		st.ino = sys.Ino
	}
	return st, nil
}

// NewBranches returns an empty cache watching HEAD files with w. onChange
// (optional) is called on w's callback goroutine when a cached branch
// changes.
func NewBranches(w *Watcher, onChange func(repoRoot, oldBranch, newBranch string)) *Branches {
	return &Branches{w: w, onChange: onChange, repos: make(map[string]*repoHead)}
}

// Branch returns the current branch of the repository whose work tree is at
// repoRoot: the branch name, or "detached@<short sha>" on a detached HEAD.
// The first call reads HEAD and starts watching it; later calls answer from
// the cache.
func (b *Branches) Branch(repoRoot string) (string, error) {
	root := filepath.Clean(repoRoot)
	for {
		b.mu.RLock()
		e := b.repos[root]
		b.mu.RUnlock()
		if e == nil {
			return b.load(root)
		}
		<-e.loaded
		if e.err != nil {
			return "", e.err
		}
		b.mu.RLock()
		branch, stamp, current := e.branch, e.stamp, b.repos[root] == e
		b.mu.RUnlock()
		if !current {
			continue // forgotten or invalidated meanwhile: look again
		}
		if now, err := stampOf(e.head); err == nil && now == stamp {
			return branch, nil
		}
		// HEAD changed and the watcher has not caught up yet.
		b.refresh(root, e)
	}
}

// load reads HEAD for the first time and starts watching it. Concurrent
// first calls for one repository share one read.
func (b *Branches) load(root string) (string, error) {
	e := &repoHead{loaded: make(chan struct{})}
	b.mu.Lock()
	if cur := b.repos[root]; cur != nil {
		b.mu.Unlock()
		return b.Branch(root)
	}
	b.repos[root] = e
	b.mu.Unlock()

	branch, stamp, err := b.start(root, e)
	b.mu.Lock()
	if err != nil {
		e.err = err
		if b.repos[root] == e {
			delete(b.repos, root) // not cached: the next call reads again
		}
	} else {
		e.branch, e.stamp = branch, stamp
	}
	b.mu.Unlock()
	close(e.loaded)
	if err != nil && e.cancel != nil {
		e.cancel()
	}
	return branch, err
}

func (b *Branches) start(root string, e *repoHead) (string, fileStamp, error) {
	gitDir, err := resolveGitDir(root)
	if err != nil {
		return "", fileStamp{}, err
	}
	e.head = filepath.Join(gitDir, "HEAD")
	// Watch before reading, so a change in between is reported.
	cancel, err := b.w.WatchFile(e.head, func() { b.refresh(root, e) })
	if err != nil {
		return "", fileStamp{}, fmt.Errorf("watch HEAD of %s: %w", root, err)
	}
	e.cancel = cancel
	return b.read(root, e.head)
}

// refresh re-reads HEAD after the watcher saw it change.
func (b *Branches) refresh(root string, e *repoHead) {
	<-e.loaded
	if e.err != nil {
		return
	}
	branch, stamp, err := b.read(root, e.head)
	b.mu.Lock()
	if b.repos[root] != e {
		b.mu.Unlock()
		return
	}
	if err != nil {
		// Never answer with a stale branch: drop the entry so the next
		// Branch call reads HEAD again and reports what is wrong.
		delete(b.repos, root)
		b.mu.Unlock()
		e.cancel()
		b.w.log.Warn("re-read HEAD after a change", "repo", root, "err", err)
		return
	}
	old := e.branch
	e.branch, e.stamp = branch, stamp
	b.mu.Unlock()
	if old != branch && b.onChange != nil {
		b.onChange(root, old, branch)
	}
}

// Forget drops the cached branch of repoRoot and stops watching its HEAD.
func (b *Branches) Forget(repoRoot string) {
	root := filepath.Clean(repoRoot)
	b.mu.Lock()
	e := b.repos[root]
	delete(b.repos, root)
	b.mu.Unlock()
	if e == nil {
		return
	}
	<-e.loaded
	if e.cancel != nil {
		e.cancel()
	}
}

// Reads is how many times a HEAD file was read from disk.
func (b *Branches) Reads() uint64 { return b.reads.Load() }

// read reads HEAD. The stamp is taken before the content, so a change in
// between leaves an older stamp and the next Branch call reads again.
func (b *Branches) read(root, head string) (string, fileStamp, error) {
	b.reads.Add(1)
	stamp, err := stampOf(head)
	if err != nil {
		return "", fileStamp{}, errdefs.Invalid(fmt.Errorf("read the current branch of %s: %w", root, err))
	}
	data, err := os.ReadFile(head)
	if err != nil {
		return "", fileStamp{}, errdefs.Invalid(fmt.Errorf("read the current branch of %s: %w", root, err))
	}
	branch, err := parseHead(data)
	if err != nil {
		return "", fileStamp{}, errdefs.Invalid(fmt.Errorf("read the current branch of %s from %s: %w", root, head, err))
	}
	return branch, stamp, nil
}

// resolveGitDir returns the git directory of the work tree at root: root/.git,
// or where a .git file ("gitdir: <path>", written for worktrees and
// submodules) points.
func resolveGitDir(root string) (string, error) {
	dotGit := filepath.Join(root, ".git")
	info, err := os.Stat(dotGit)
	if err != nil {
		return "", errdefs.Invalid(fmt.Errorf("%s is not the root of a git work tree: %w", root, err))
	}
	if info.IsDir() {
		return dotGit, nil
	}
	data, err := os.ReadFile(dotGit)
	if err != nil {
		return "", errdefs.Invalid(fmt.Errorf("read %s: %w", dotGit, err))
	}
	line, _, _ := bytes.Cut(data, []byte("\n"))
	target, ok := strings.CutPrefix(strings.TrimSpace(string(line)), "gitdir:")
	target = strings.TrimSpace(target)
	if !ok || target == "" {
		return "", errdefs.Invalid(fmt.Errorf("%s is a file without a \"gitdir: <path>\" line; repair the work tree (git worktree repair) and retry", dotGit))
	}
	if !filepath.IsAbs(target) {
		target = filepath.Join(root, target)
	}
	return filepath.Clean(target), nil
}

// errReftable: with the reftable backend, HEAD holds a placeholder and the
// branch lives in binary tables this package does not read.
var errReftable = errors.New("the repository uses the reftable ref format, which sandboxd cannot read without git; use a repository with the files ref format")

// parseHead turns the content of a HEAD file into the branch name, the way
// `git branch --show-current` (or, when detached, `git rev-parse --short
// HEAD`) would.
func parseHead(data []byte) (string, error) {
	s := strings.TrimSpace(string(data))
	if ref, ok := strings.CutPrefix(s, "ref:"); ok {
		ref = strings.TrimSpace(ref)
		name, ok := strings.CutPrefix(ref, "refs/heads/")
		switch {
		case !ok || name == "":
			return "", fmt.Errorf("HEAD points at %q, which is not a branch", ref)
		case name == ".invalid":
			return "", errReftable
		}
		return name, nil
	}
	if (len(s) == 40 || len(s) == 64) && isHex(s) {
		return DetachedPrefix + s[:shortSHALen], nil
	}
	return "", fmt.Errorf("HEAD holds neither a branch ref nor a commit id (%q); the repository may be corrupt", truncate(s, 80))
}

func isHex(s string) bool {
	for _, c := range s {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

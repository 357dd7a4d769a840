//go:build linux

package watch

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// treeMask is what a directory watch reports: entries appearing, changing
// (content or mode) and going away, and the directory itself going away.
const treeMask = unix.IN_CREATE | unix.IN_DELETE | unix.IN_MODIFY | unix.IN_ATTRIB |
	unix.IN_MOVED_FROM | unix.IN_MOVED_TO | unix.IN_DELETE_SELF | unix.IN_MOVE_SELF |
	unix.IN_ONLYDIR | unix.IN_DONT_FOLLOW | unix.IN_EXCL_UNLINK

// inotifyTrees uses raw inotify rather than fsnotify: a directory moved
// inside the tree must get its new path, and fsnotify's bookkeeping keeps
// the old one for a watch the kernel reuses.
type inotifyTrees struct {
	t    *Trees
	f    *os.File // the inotify descriptor, read through the runtime poller
	fd   int
	done chan struct{}

	mu      sync.Mutex
	started bool
	closed  bool
	err     error             // inotify unavailable: every answer is full
	trees   map[string]*itree // by root
	wds     map[int32]watchRef
	cookies map[string]chan struct{} // marker file → its waiter
	seq     uint64
}

type watchRef struct {
	tree   *itree
	rel    string // the directory, relative to the root ("" is the root)
	cookie bool   // the tree's marker directory
}

type itree struct {
	root, cookieDir string
	dirs            map[string]int32 // watched directory → watch descriptor
	cookieWD        int32
	dirty           map[string]struct{}
	gone            map[string]struct{}
	// overflow: paths were lost since the last answer (queue overflow,
	// too many paths, a new nested repository).
	overflow bool
	// broken: the tree cannot be tracked (a watch could not be placed,
	// the root went away); every answer is full.
	broken bool
	// baseline: the last answer was given with the tree fully watched,
	// so the paths since then are complete.
	baseline bool
	lastUse  time.Time
}

func newTreeBackend(t *Trees) treeBackend {
	return &inotifyTrees{t: t, trees: map[string]*itree{}, wds: map[int32]watchRef{}, cookies: map[string]chan struct{}{}, done: make(chan struct{})}
}

// openLocked opens the inotify instance on first use (instances are few per
// user; a daemon that never syncs holds none). Called with b.mu held.
func (b *inotifyTrees) openLocked() {
	if b.started {
		return
	}
	b.started = true
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		b.err = err
		close(b.done)
		b.t.log.Warn("watching working trees unavailable: every synced exec scans the whole tree; raise fs.inotify.max_user_instances to fix", "err", err)
		return
	}
	b.fd = fd
	b.f = os.NewFile(uintptr(fd), "inotify")
	go b.read()
}

func (b *inotifyTrees) changes(ctx context.Context, root, cookieDir string) ([]string, []string, bool) {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil, nil, true
	}
	b.openLocked()
	if b.err != nil {
		b.mu.Unlock()
		return nil, nil, true
	}
	tr := b.trees[root]
	if tr != nil && tr.cookieDir != cookieDir {
		b.dropLocked(tr)
		tr = nil
	}
	if tr == nil {
		tr = b.startLocked(root, cookieDir)
	}
	tr.lastUse = b.t.now()
	if tr.broken {
		b.mu.Unlock()
		return nil, nil, true
	}
	// The barrier: a marker file created now is seen after every event
	// queued before it, on any watch of this descriptor.
	b.seq++
	name := filepath.Join(cookieDir, fmt.Sprintf("cookie-%d-%d", os.Getpid(), b.seq))
	seen := make(chan struct{})
	b.cookies[name] = seen
	b.mu.Unlock()

	ok := false
	if f, err := os.OpenFile(name, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600); err == nil {
		_ = f.Close()
		timer := time.NewTimer(b.t.barrier)
		select {
		case <-seen:
			ok = true
		case <-timer.C:
			b.t.log.Warn("working tree watch: the barrier timed out; scanning the whole tree", "root", root)
		case <-ctx.Done():
		case <-b.done:
		}
		timer.Stop()
		_ = os.Remove(name)
	} else {
		b.t.log.Warn("working tree watch: cannot write the barrier marker; scanning the whole tree", "file", name, "err", err)
	}

	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.cookies, name)
	if b.trees[root] != tr {
		return nil, nil, true // dropped meanwhile
	}
	full := !ok || !tr.baseline || tr.overflow || tr.broken
	var paths, gone []string
	if !full {
		paths = make([]string, 0, len(tr.dirty))
		for p := range tr.dirty {
			paths = append(paths, p)
		}
		gone = make([]string, 0, len(tr.gone))
		for p := range tr.gone {
			gone = append(gone, p)
		}
	}
	tr.dirty, tr.gone = map[string]struct{}{}, map[string]struct{}{}
	tr.overflow = false
	// An answer after a timed-out barrier is full; events still queued
	// land in the next answer, whose own barrier waits for them.
	tr.baseline = !tr.broken
	return paths, gone, full
}

// startLocked begins tracking root: the marker directory's watch, then
// every directory's. The first answer is full whatever happens here.
func (b *inotifyTrees) startLocked(root, cookieDir string) *itree {
	tr := &itree{root: root, cookieDir: cookieDir, dirs: map[string]int32{}, dirty: map[string]struct{}{}, gone: map[string]struct{}{}}
	b.trees[root] = tr
	err := os.MkdirAll(cookieDir, 0o755)
	if err == nil {
		var wd int
		wd, err = unix.InotifyAddWatch(b.fd, cookieDir, unix.IN_CREATE|unix.IN_ONLYDIR|unix.IN_DELETE_SELF|unix.IN_MOVE_SELF)
		if err == nil {
			if _, taken := b.wds[int32(wd)]; taken {
				err = errors.New("the marker directory is watched for another tree")
			} else {
				tr.cookieWD = int32(wd)
				b.wds[int32(wd)] = watchRef{tree: tr, cookie: true}
			}
		}
	}
	if err == nil {
		err = b.walkLocked(tr, "", false)
	}
	if err != nil {
		b.breakLocked(tr, err)
	}
	return tr
}

// breakLocked gives up on a tree: its watches are released and every
// answer is full until it is dropped.
func (b *inotifyTrees) breakLocked(tr *itree, err error) {
	if tr.broken {
		return
	}
	msg := "working tree watch unavailable: every synced exec of this repository scans the whole tree"
	if errors.Is(err, unix.ENOSPC) {
		msg += "; raise fs.inotify.max_user_watches to fix"
	}
	b.t.log.Warn(msg, "root", tr.root, "err", err)
	tr.broken = true
	b.unwatchLocked(tr, "", true)
}

// walkLocked watches directory rel and everything under it, the watch
// first so nothing created meanwhile is missed; with record, every entry
// is reported as changed.
func (b *inotifyTrees) walkLocked(tr *itree, rel string, record bool) error {
	abs := filepath.Join(tr.root, filepath.FromSlash(rel))
	wd, err := unix.InotifyAddWatch(b.fd, abs, treeMask)
	if err != nil {
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
			return nil // gone again: its parent reports it
		}
		return fmt.Errorf("watch %s: %w", abs, err)
	}
	if ref, taken := b.wds[int32(wd)]; taken {
		if ref.tree != tr || ref.rel != rel {
			return fmt.Errorf("watch %s: the directory is also at %s", abs, filepath.Join(ref.tree.root, ref.rel))
		}
	}
	b.wds[int32(wd)] = watchRef{tree: tr, rel: rel}
	tr.dirs[rel] = int32(wd)
	entries, err := os.ReadDir(abs)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("read %s: %w", abs, err)
	}
	for _, e := range entries {
		if e.Name() == ".git" {
			if rel != "" {
				// rel became a repository between the check of its
				// parent and this read (its .git event came before the
				// watch): git add -A stages it as a submodule, so scan.
				tr.scanAll()
			}
			continue
		}
		child := joinRel(rel, e.Name())
		if record {
			b.markLocked(tr, child)
		}
		if !e.IsDir() {
			continue
		}
		if !nestedRepo(filepath.Join(abs, e.Name())) {
			if err := b.walkLocked(tr, child, record); err != nil {
				return err
			}
		} else if record {
			// A repository that came with a new directory (its .git made
			// before the watch below was placed): git add -A stages it as
			// a submodule, so scan, as when its .git appears later.
			tr.scanAll()
		}
	}
	return nil
}

// nestedRepo: a directory with its own .git is another repository (git
// does not look inside), so it is not watched.
func nestedRepo(dir string) bool {
	_, err := os.Lstat(filepath.Join(dir, ".git"))
	return err == nil
}

// unwatchLocked releases the watches of rel and below (all, cookie
// included, when whole).
func (b *inotifyTrees) unwatchLocked(tr *itree, rel string, whole bool) {
	for d, wd := range tr.dirs {
		if whole || d == rel || strings.HasPrefix(d, rel+"/") {
			_, _ = unix.InotifyRmWatch(b.fd, uint32(wd))
			if ref, ok := b.wds[wd]; ok && ref.tree == tr {
				delete(b.wds, wd)
			}
			delete(tr.dirs, d)
		}
	}
	if whole && tr.cookieWD != 0 {
		_, _ = unix.InotifyRmWatch(b.fd, uint32(tr.cookieWD))
		if ref, ok := b.wds[tr.cookieWD]; ok && ref.tree == tr {
			delete(b.wds, tr.cookieWD)
		}
		tr.cookieWD = 0
	}
}

func (b *inotifyTrees) dropLocked(tr *itree) {
	b.unwatchLocked(tr, "", true)
	delete(b.trees, tr.root)
}

func (b *inotifyTrees) markLocked(tr *itree, rel string) {
	if tr.overflow {
		return
	}
	tr.dirty[rel] = struct{}{}
	b.checkSizeLocked(tr)
}

func (b *inotifyTrees) checkSizeLocked(tr *itree) {
	if len(tr.dirty)+len(tr.gone) > b.t.maxDirt {
		tr.scanAll()
	}
}

// scanAll makes the tree's next answer full: the paths since the last one
// are not all known, and those that are no longer matter.
func (tr *itree) scanAll() {
	tr.overflow = true
	tr.dirty, tr.gone = map[string]struct{}{}, map[string]struct{}{}
}

func (b *inotifyTrees) sweep(before time.Time, max int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, tr := range b.trees {
		if tr.lastUse.Before(before) {
			b.dropLocked(tr)
		}
	}
	for len(b.trees) > max {
		var oldest *itree
		for _, tr := range b.trees {
			if oldest == nil || tr.lastUse.Before(oldest.lastUse) {
				oldest = tr
			}
		}
		b.dropLocked(oldest)
	}
}

func (b *inotifyTrees) close() error {
	b.mu.Lock()
	started, failed := b.started, b.err != nil
	b.started, b.closed = true, true
	b.mu.Unlock()
	if !started || failed {
		return nil
	}
	err := b.f.Close()
	<-b.done
	return err
}

// read handles the kernel's events until the descriptor is closed.
func (b *inotifyTrees) read() {
	defer close(b.done)
	buf := make([]byte, 64<<10)
	for {
		n, err := b.f.Read(buf)
		if err != nil {
			if !errors.Is(err, os.ErrClosed) {
				b.t.log.Warn("working tree watch stopped: every synced exec scans the whole tree", "err", err)
			}
			b.mu.Lock()
			for _, tr := range b.trees {
				tr.broken = true
			}
			b.mu.Unlock()
			return
		}
		b.mu.Lock()
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
			name := ""
			if ev.Len > 0 {
				raw := buf[off+unix.SizeofInotifyEvent : off+unix.SizeofInotifyEvent+int(ev.Len)]
				name = strings.TrimRight(string(raw), "\x00")
			}
			b.eventLocked(ev.Wd, ev.Mask, name)
			off += unix.SizeofInotifyEvent + int(ev.Len)
		}
		b.mu.Unlock()
	}
}

func (b *inotifyTrees) eventLocked(wd int32, mask uint32, name string) {
	if mask&unix.IN_Q_OVERFLOW != 0 {
		b.t.log.Warn("working tree watch: the kernel's event queue overflowed; the next synced exec scans the whole tree")
		for _, tr := range b.trees {
			tr.scanAll()
		}
		return
	}
	ref, ok := b.wds[wd]
	if !ok {
		return // a watch released meanwhile
	}
	tr := ref.tree
	if mask&unix.IN_IGNORED != 0 {
		delete(b.wds, wd)
		if ref.cookie {
			tr.cookieWD = 0
			b.breakLocked(tr, errors.New("the marker directory went away"))
		} else if tr.dirs[ref.rel] == wd {
			delete(tr.dirs, ref.rel)
			if ref.rel == "" {
				b.breakLocked(tr, errors.New("the working tree went away"))
			}
		}
		return
	}
	if mask&(unix.IN_DELETE_SELF|unix.IN_MOVE_SELF|unix.IN_UNMOUNT) != 0 {
		if ref.cookie || ref.rel == "" {
			b.breakLocked(tr, errors.New("the working tree or its marker directory moved or went away"))
		}
		return // the parent reports the entry
	}
	if ref.cookie {
		if mask&unix.IN_CREATE != 0 {
			if ch, ok := b.cookies[filepath.Join(tr.cookieDir, name)]; ok {
				close(ch)
				delete(b.cookies, filepath.Join(tr.cookieDir, name))
			}
		}
		return
	}
	if name == "" || tr.broken {
		return // the directory's own attributes: git keeps none
	}
	if name == ".git" {
		if ref.rel != "" {
			// A repository appeared or went inside the tree: what git
			// sees below it changes; scan everything.
			tr.scanAll()
		}
		return
	}
	rel := joinRel(ref.rel, name)
	isDir := mask&unix.IN_ISDIR != 0
	switch {
	case isDir && mask&(unix.IN_DELETE|unix.IN_MOVED_FROM) != 0:
		b.unwatchLocked(tr, rel, false)
		if !tr.overflow {
			tr.gone[rel] = struct{}{}
			b.checkSizeLocked(tr)
		}
	case isDir && mask&(unix.IN_CREATE|unix.IN_MOVED_TO) != 0:
		b.markLocked(tr, rel)
		if nestedRepo(filepath.Join(tr.root, filepath.FromSlash(rel))) {
			// git add -A stages a repository as a submodule: scan.
			tr.scanAll()
		} else if err := b.walkLocked(tr, rel, true); err != nil {
			b.breakLocked(tr, err)
		}
	case isDir:
		// A directory's mode or times: git keeps none.
	default:
		b.markLocked(tr, rel)
	}
}

func joinRel(dir, name string) string {
	if dir == "" {
		return name
	}
	return dir + "/" + name
}

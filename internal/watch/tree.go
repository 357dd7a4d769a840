package watch

import (
	"context"
	"log/slog"
	"sort"
	"sync"
	"time"
)

// Defaults of TreesOptions.
const (
	DefaultBarrierTimeout = 5 * time.Second
	DefaultTreeIdle       = 30 * time.Minute
	DefaultMaxTrees       = 16
	DefaultMaxDirty       = 10000
)

// TreesOptions configure Trees. Zero values select the defaults.
type TreesOptions struct {
	Logger *slog.Logger
	// BarrierTimeout bounds the wait for the kernel's queue to be read up to
	// a Changes call; past it the call answers "unknown" (full).
	BarrierTimeout time.Duration
	// Idle is how long a tree is tracked without a Changes call.
	Idle time.Duration
	// MaxTrees caps the trees tracked at once; the least recently used
	// is dropped (its next Changes answers full).
	MaxTrees int
	// MaxDirty caps the paths remembered per tree; past it the tree's
	// next Changes answers full.
	MaxDirty int
	Now      func() time.Time
	// disable makes every Changes answer full, for tests of the fallback.
	disable bool
}

// Trees tracks, per working tree, which paths changed since the previous
// Changes call, with a recursive inotify watch (one watch per directory,
// the .git directory and nested repositories left out). Whenever it cannot
// be sure (first call, queue overflow, a watch that could not be placed,
// the barrier timing out, a platform without inotify) Changes says so and
// the caller scans everything: it never answers with a set that misses a
// change.
type Trees struct {
	log     *slog.Logger
	barrier time.Duration
	idle    time.Duration
	max     int
	maxDirt int
	now     func() time.Time
	impl    treeBackend
	mu      sync.Mutex
	closed  bool
}

// treeBackend is the platform's part.
type treeBackend interface {
	// changes is Changes for one tree.
	changes(ctx context.Context, root, cookieDir string) (paths, gone []string, full bool)
	// drop stops tracking trees not used since before, and beyond max.
	sweep(before time.Time, max int)
	close() error
}

// NewTrees starts tracking nothing; trees are added by their first Changes.
func NewTrees(o TreesOptions) *Trees {
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.BarrierTimeout <= 0 {
		o.BarrierTimeout = DefaultBarrierTimeout
	}
	if o.Idle <= 0 {
		o.Idle = DefaultTreeIdle
	}
	if o.MaxTrees <= 0 {
		o.MaxTrees = DefaultMaxTrees
	}
	if o.MaxDirty <= 0 {
		o.MaxDirty = DefaultMaxDirty
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	t := &Trees{log: o.Logger, barrier: o.BarrierTimeout, idle: o.Idle, max: o.MaxTrees, maxDirt: o.MaxDirty, now: o.Now}
	if !o.disable {
		t.impl = newTreeBackend(t)
	}
	return t
}

// Changes returns the paths under root (slash-separated, relative) changed
// since the previous Changes call for root, once every change made before
// this call has been read from the kernel. paths are files, symlinks and
// directories that appeared, changed or went away; gone are directories
// whose whole subtree went away (deleted or moved elsewhere) — a directory
// that appears is reported with everything under it. full says the set is
// unknown: the caller must look at the whole tree. The first call for a
// root starts tracking it and answers full. cookieDir, a directory of the
// caller's outside the tree (in .git), holds the short-lived marker files
// of the barrier.
func (t *Trees) Changes(ctx context.Context, root, cookieDir string) (paths, gone []string, full bool) {
	t.mu.Lock()
	impl, closed := t.impl, t.closed
	t.mu.Unlock()
	if impl == nil || closed {
		return nil, nil, true
	}
	impl.sweep(t.now().Add(-t.idle), t.max)
	paths, gone, full = impl.changes(ctx, root, cookieDir)
	if full {
		return nil, nil, true
	}
	sort.Strings(paths)
	sort.Strings(gone)
	return paths, gone, false
}

// Close stops tracking; later Changes calls answer full.
func (t *Trees) Close() error {
	t.mu.Lock()
	impl := t.impl
	t.closed = true
	t.mu.Unlock()
	if impl != nil {
		return impl.close()
	}
	return nil
}

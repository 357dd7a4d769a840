package gitsync

import (
	"testing"

	"github.com/sandboxd/sandboxd/internal/watch"
)

// newBenchSyncer is a Syncer as the daemon builds it, with its working
// tree tracker (BENCH_FULL_SCAN=1: without, as before the tracker).
func newBenchSyncer(b *testing.B) *Syncer {
	if benchFullScan {
		return New(Options{})
	}
	trees := watch.NewTrees(watch.TreesOptions{})
	b.Cleanup(func() { _ = trees.Close() })
	return New(Options{Changes: trees})
}

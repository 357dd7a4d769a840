//go:build !linux

package watch

// newTreeBackend: without inotify (kqueue would hold a descriptor per
// file), every answer is full and the sync scans the whole tree.
func newTreeBackend(*Trees) treeBackend { return nil }

package gitsync

import (
	"os"
	"syscall"
)

// inodeAndCtime: a file replaced by rename or rewritten within the same
// mtime tick still gets a new inode or ctime.
func inodeAndCtime(fi os.FileInfo) (uint64, int64) {
	if sys, ok := fi.Sys().(*syscall.Stat_t); ok {
		return sys.Ino, sys.Ctimespec.Sec*1e9 + sys.Ctimespec.Nsec
	}
	return 0, 0
}

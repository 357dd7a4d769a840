package sandboxhelper

import (
	"os"
	"syscall"
)

func stampOf(path string) (stamp, bool) {
	fi, err := os.Stat(path)
	if err != nil {
		return stamp{}, false
	}
	st := stamp{Size: fi.Size(), Mtime: fi.ModTime().UnixNano()}
	if sys, ok := fi.Sys().(*syscall.Stat_t); ok {
		st.Ino, st.Ctime = sys.Ino, sys.Ctim.Sec*1e9+sys.Ctim.Nsec
	}
	return st, true
}

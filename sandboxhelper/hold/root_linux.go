package hold

import (
	"os"
	"path/filepath"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// minMemRoot is the least size of a memory file system the holder uses:
// a container's 64 MiB /dev/shm is left to the programs that need it.
const minMemRoot = 1 << 30

// memRoot is base/sandboxd-UID (base: /dev/shm), made if missing, when
// base is a memory file system of at least minMemRoot, the directory is
// the user's alone (a directory, not a link, owned by uid, mode 0700),
// and logind keeps no record of the user in users (/run/systemd/users):
// logind removes a user's files in /dev/shm when their last session ends
// (RemoveIPC), which a dropped connection can be.
func memRoot(base, users string, uid int) (string, bool) {
	var fs unix.Statfs_t
	if unix.Statfs(base, &fs) != nil || fs.Type != unix.TMPFS_MAGIC || uint64(fs.Blocks)*uint64(fs.Bsize) < minMemRoot {
		return "", false
	}
	if _, err := os.Lstat(filepath.Join(users, strconv.Itoa(uid))); err == nil {
		return "", false
	}
	dir := filepath.Join(base, "sandboxd-"+strconv.Itoa(uid))
	_ = os.Mkdir(dir, 0o700)
	fi, err := os.Lstat(dir)
	if err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o700 {
		return "", false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || int(st.Uid) != uid {
		return "", false
	}
	return dir, true
}

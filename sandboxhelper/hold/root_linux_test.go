package hold

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// TestMemRootIsTakenOnlyWhenItIsTheUsersAloneOnALargeTmpfs: the holder
// keeps its execs in memory only on a memory file system of a fitting
// size, in a directory of the user's alone, and never where logind may
// remove the user's files when their sessions end.
func TestMemRootIsTakenOnlyWhenItIsTheUsersAloneOnALargeTmpfs(t *testing.T) {
	var fs unix.Statfs_t
	if unix.Statfs("/dev/shm", &fs) != nil || fs.Type != unix.TMPFS_MAGIC || uint64(fs.Blocks)*uint64(fs.Bsize) < minMemRoot {
		t.Skip("this machine's /dev/shm is not a memory file system of 1 GiB")
	}
	base, err := os.MkdirTemp("/dev/shm", "holdtest")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	users := t.TempDir()
	uid := os.Getuid()
	want := filepath.Join(base, "sandboxd-"+strconv.Itoa(uid))

	if dir, ok := memRoot(base, users, uid); !ok || dir != want {
		t.Fatalf("memRoot on a tmpfs: %q %v, want %q", dir, ok, want)
	}
	if fi, err := os.Lstat(want); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("the directory made: %v %v, want mode 0700", fi, err)
	}
	if _, ok := memRoot(t.TempDir(), users, uid); ok {
		t.Error("memRoot took a directory on a disk file system")
	}
	if _, ok := memRoot(base, users, uid+1); ok {
		t.Error("memRoot took a directory owned by another user")
	}
	record := filepath.Join(users, strconv.Itoa(uid))
	if err := os.WriteFile(record, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, ok := memRoot(base, users, uid); ok {
		t.Error("memRoot took /dev/shm for a user logind keeps a record of")
	}
	os.Remove(record)
	if err := os.Chmod(want, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, ok := memRoot(base, users, uid); ok {
		t.Error("memRoot took a directory others can read")
	}
	os.Remove(want)
	if err := os.Symlink(t.TempDir(), want); err != nil {
		t.Fatal(err)
	}
	if _, ok := memRoot(base, users, uid); ok {
		t.Error("memRoot took a symbolic link")
	}
}

package peercred

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// readPeerCred reads the credentials of the process on the other end of
// Unix socket fd: LOCAL_PEERCRED (what getpeereid(3) reads) for the user
// and group, LOCAL_PEERPID for the pid. Built and vetted for macOS, not
// run by the tests here (they run on Linux).
func readPeerCred(fd int) (uid, gid, pid int, err error) {
	cred, err := unix.GetsockoptXucred(fd, unix.SOL_LOCAL, unix.LOCAL_PEERCRED)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("LOCAL_PEERCRED: %w", err)
	}
	if cred.Ngroups > 0 {
		gid = int(cred.Groups[0])
	}
	pid, err = unix.GetsockoptInt(fd, unix.SOL_LOCAL, unix.LOCAL_PEERPID)
	if err != nil {
		pid = 0 // the pid is for logs only; the uid is what is checked
	}
	return int(cred.Uid), gid, pid, nil
}

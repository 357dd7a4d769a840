package peercred

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// readPeerCred reads the credentials of the process on the other end of
// Unix socket fd (SO_PEERCRED).
func readPeerCred(fd int) (uid, gid, pid int, err error) {
	cred, err := unix.GetsockoptUcred(fd, unix.SOL_SOCKET, unix.SO_PEERCRED)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("SO_PEERCRED: %w", err)
	}
	return int(cred.Uid), int(cred.Gid), int(cred.Pid), nil
}

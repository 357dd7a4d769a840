package client

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// peerUID returns the user the process on the other end of a Unix socket
// connection runs as (SO_PEERCRED: the server's credentials when it called
// listen). known is false where the platform cannot tell.
func peerUID(c net.Conn) (uid int, known bool, err error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return 0, false, fmt.Errorf("the connection is not a Unix socket (%T)", c)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return 0, false, err
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, false, err
	}
	if credErr != nil {
		return 0, false, fmt.Errorf("SO_PEERCRED: %w", credErr)
	}
	return int(cred.Uid), true, nil
}

package client

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// peerUID returns the user the process on the other end of a Unix socket
// connection runs as (LOCAL_PEERCRED, what getpeereid(3) reads). Built and
// vetted for macOS, not run by the tests here (they run on Linux).
func peerUID(c net.Conn) (uid int, known bool, err error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return 0, false, fmt.Errorf("the connection is not a Unix socket (%T)", c)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return 0, false, err
	}
	var cred *unix.Xucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptXucred(int(fd), unix.SOL_LOCAL, unix.LOCAL_PEERCRED)
	}); err != nil {
		return 0, false, err
	}
	if credErr != nil {
		return 0, false, fmt.Errorf("LOCAL_PEERCRED: %w", credErr)
	}
	return int(cred.Uid), true, nil
}

// Package peercred reads the identity of the process on the other end of a
// Unix socket connection. Both ends of the socket API use it: the server to
// serve only its own user, the client to talk only to its own user's daemon.
package peercred

import (
	"fmt"
	"syscall"
)

// Read reads the credentials of the process on the other end of a Unix
// socket connection (a *net.UnixConn, or an *os.File of a socket):
// SO_PEERCRED on Linux (for a client, the server's when it called listen),
// LOCAL_PEERCRED on macOS (readPeerCred).
func Read(c any) (uid, gid, pid int, err error) {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return 0, 0, 0, fmt.Errorf("connection is not a Unix socket (%T), so its user cannot be checked", c)
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return 0, 0, 0, fmt.Errorf("read peer credentials: %w", err)
	}
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		uid, gid, pid, credErr = readPeerCred(int(fd))
	}); err != nil {
		return 0, 0, 0, fmt.Errorf("read peer credentials: %w", err)
	}
	if credErr != nil {
		return 0, 0, 0, fmt.Errorf("read peer credentials: %w", credErr)
	}
	return uid, gid, pid, nil
}

package ipc

import (
	"context"
	"errors"
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// peer is the identity of a connection's other end, read once per
// connection with SO_PEERCRED.
type peer struct {
	uid, gid, pid int
	err           error // why the identity is unknown
}

type peerKey struct{}

// peerOf reads SO_PEERCRED from a Unix socket connection.
func peerOf(c net.Conn) peer {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return peer{err: fmt.Errorf("connection is not a Unix socket (%T), so its user cannot be checked", c)}
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return peer{err: fmt.Errorf("read peer credentials: %w", err)}
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return peer{err: fmt.Errorf("read peer credentials: %w", err)}
	}
	if credErr != nil {
		return peer{err: fmt.Errorf("read peer credentials (SO_PEERCRED): %w", credErr)}
	}
	return peer{uid: int(cred.Uid), gid: int(cred.Gid), pid: int(cred.Pid)}
}

func withPeer(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, peerKey{}, peerOf(c))
}

func peerFrom(ctx context.Context) (peer, error) {
	p, ok := ctx.Value(peerKey{}).(peer)
	if !ok {
		return peer{}, errors.New("no peer credentials for this connection: serve the handler with Server.Serve")
	}
	return p, p.err
}

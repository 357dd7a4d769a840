package ipc

import (
	"context"
	"errors"
	"fmt"
	"net"
)

// peer is the identity of a connection's other end, read once per
// connection (SO_PEERCRED on Linux, LOCAL_PEERCRED on macOS: readPeerCred).
type peer struct {
	uid, gid, pid int
	err           error // why the identity is unknown
}

type peerKey struct{}

// peerOf reads the peer credentials of a Unix socket connection.
func peerOf(c net.Conn) peer {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return peer{err: fmt.Errorf("connection is not a Unix socket (%T), so its user cannot be checked", c)}
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return peer{err: fmt.Errorf("read peer credentials: %w", err)}
	}
	var uid, gid, pid int
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		uid, gid, pid, credErr = readPeerCred(int(fd))
	}); err != nil {
		return peer{err: fmt.Errorf("read peer credentials: %w", err)}
	}
	if credErr != nil {
		return peer{err: fmt.Errorf("read peer credentials: %w", credErr)}
	}
	return peer{uid: uid, gid: gid, pid: pid}
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

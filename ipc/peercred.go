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

// PeerCred reads the credentials of the process on the other end of a Unix
// socket connection: SO_PEERCRED on Linux (for a client, the server's when
// it called listen), LOCAL_PEERCRED on macOS (readPeerCred).
func PeerCred(c net.Conn) (uid, gid, pid int, err error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return 0, 0, 0, fmt.Errorf("connection is not a Unix socket (%T), so its user cannot be checked", c)
	}
	raw, err := uc.SyscallConn()
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

// peerOf reads the peer credentials of a Unix socket connection.
func peerOf(c net.Conn) peer {
	uid, gid, pid, err := PeerCred(c)
	if err != nil {
		return peer{err: err}
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

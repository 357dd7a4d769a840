package server

import (
	"context"
	"errors"
	"net"

	"github.com/sandboxd/sandboxd/ipc/peercred"
)

// peer is the identity of a connection's other end, read once per
// connection.
type peer struct {
	uid, gid, pid int
	err           error // why the identity is unknown
}

type peerKey struct{}

// peerOf reads the peer credentials of a Unix socket connection.
func peerOf(c net.Conn) peer {
	uid, gid, pid, err := peercred.Read(c)
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

package client

import (
	"bufio"
	"context"
	"fmt"
	"io"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// SSHHosts is GET /v1/ssh/hosts: the live sandboxes as OpenSSH hosts (the
// daemon writes their key files).
func (c *Client) SSHHosts(ctx context.Context) (ipc.SSHHostsResponse, error) {
	return call[ipc.SSHHostsResponse](ctx, c, methodGet, "/v1/ssh/hosts", nil, nil)
}

// SSHProxy is POST /v1/ssh/proxy: it returns the connection, now carrying
// the SSH stream of the sandbox req names. ctx bounds the request until the
// daemon switches protocols; the stream is then the caller's, who closes
// it.
func (c *Client) SSHProxy(ctx context.Context, req ipc.SSHProxyRequest) (io.ReadWriteCloser, error) {
	r, err := jsonRequest(methodPost, "/v1/ssh/proxy", nil, req)
	if err != nil {
		return nil, err
	}
	r.upgrade = ipc.SSHProxyProtocol
	resp, cc, err := c.roundTrip(ctx, r)
	if err != nil {
		return nil, err
	}
	if resp.status != 101 {
		cc.close()
		return nil, errdefs.Internal(fmt.Errorf("sandboxd answered %d to a proxy request instead of switching protocols: is it an older version? (nook version)", resp.status))
	}
	cc.stop()
	return &upgraded{conn: cc.conn, br: cc.br}, nil
}

// upgraded is a connection after a 101: the bytes that came behind the
// answer's head are in br, so reads go through it; writes go straight to
// the connection.
type upgraded struct {
	conn
	br *bufio.Reader
}

func (u *upgraded) Read(p []byte) (int, error) { return u.br.Read(p) }

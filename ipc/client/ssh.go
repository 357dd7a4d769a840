package client

import (
	"context"
	"fmt"
	"io"
	"net/http"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// SSHHosts is GET /v1/ssh/hosts: the live sandboxes as OpenSSH hosts (the
// daemon writes their key files).
func (c *Client) SSHHosts(ctx context.Context) (ipc.SSHHostsResponse, error) {
	return call[ipc.SSHHostsResponse](ctx, c, http.MethodGet, "/v1/ssh/hosts", nil, nil)
}

// SSHProxy is POST /v1/ssh/proxy: it returns the connection, now carrying
// the SSH stream of the sandbox req names. ctx bounds the request until the
// daemon switches protocols; the stream is then the caller's, who closes
// it.
func (c *Client) SSHProxy(ctx context.Context, req ipc.SSHProxyRequest) (io.ReadWriteCloser, error) {
	r, err := jsonRequest(http.MethodPost, "/v1/ssh/proxy", nil, req)
	if err != nil {
		return nil, err
	}
	r.upgrade = ipc.SSHProxyProtocol
	resp, err := c.roundTrip(ctx, r)
	if err != nil {
		return nil, err
	}
	// After a 101, net/http hands the connection over as the body: reads
	// take first what came behind the answer's head.
	stream, ok := resp.Body.(io.ReadWriteCloser)
	if resp.StatusCode != http.StatusSwitchingProtocols || !ok {
		resp.Body.Close()
		return nil, errdefs.Internal(fmt.Errorf("sandboxd answered %d to a proxy request instead of switching protocols: is it an older version? (nook version)", resp.StatusCode))
	}
	return stream, nil
}

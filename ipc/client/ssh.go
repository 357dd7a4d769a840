package client

import (
	"bytes"
	"context"
	"encoding/json"
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
// the SSH stream of the sandbox req names. The caller closes it.
func (c *Client) SSHProxy(ctx context.Context, req ipc.SSHProxyRequest) (io.ReadWriteCloser, error) {
	b, err := json.Marshal(req)
	if err != nil {
		return nil, errdefs.Invalidf("encode the proxy request: %v", err)
	}
	hreq, err := c.newRequest(ctx, http.MethodPost, "/v1/ssh/proxy", nil, bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	hreq.Header.Set("Content-Type", "application/json")
	hreq.Header.Set("Connection", "Upgrade")
	hreq.Header.Set("Upgrade", ipc.SSHProxyProtocol)
	resp, err := c.hc.Do(hreq)
	if err != nil {
		return nil, transportError(ctx, hreq.Method, hreq.URL.Path, err)
	}
	if v := resp.Header.Get(ipc.HeaderVersion); v != "" {
		c.daemonVersion.Store(&v)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		defer resp.Body.Close()
		if resp.StatusCode/100 == 2 {
			return nil, errdefs.Internal(fmt.Errorf("sandboxd answered %d to a proxy request instead of switching protocols: is it an older version? (sbx version)", resp.StatusCode))
		}
		return nil, decodeError(resp)
	}
	rwc, ok := resp.Body.(io.ReadWriteCloser)
	if !ok {
		resp.Body.Close()
		return nil, errdefs.Internal(fmt.Errorf("the upgraded connection is not writable"))
	}
	return rwc, nil
}

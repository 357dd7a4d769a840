package client

import (
	"context"
	"encoding/json"
	"io"
	"net/http"

	"github.com/sandboxd/sandboxd/ipc"
)

// BgStart is POST /v1/bg/start.
func (c *Client) BgStart(ctx context.Context, req ipc.BgStartRequest) (ipc.BgProcess, error) {
	return call[ipc.BgProcess](ctx, c, http.MethodPost, "/v1/bg/start", nil, req)
}

// BgRestart is POST /v1/bg/restart.
func (c *Client) BgRestart(ctx context.Context, req ipc.BgRequest) (ipc.BgProcess, error) {
	return call[ipc.BgProcess](ctx, c, http.MethodPost, "/v1/bg/restart", nil, req)
}

// BgStop is POST /v1/bg/stop.
func (c *Client) BgStop(ctx context.Context, req ipc.BgRequest) (ipc.BgProcess, error) {
	return call[ipc.BgProcess](ctx, c, http.MethodPost, "/v1/bg/stop", nil, req)
}

// BgList is GET /v1/bg.
func (c *Client) BgList(ctx context.Context, req ipc.BgListRequest) (ipc.BgListResponse, error) {
	return call[ipc.BgListResponse](ctx, c, http.MethodGet, "/v1/bg", targetQuery(req), nil)
}

// BgLogs is POST /v1/bg/logs: the process's output goes to stdout and
// stderr as it comes; with req.Follow it returns when ctx ends.
func (c *Client) BgLogs(ctx context.Context, req ipc.BgRequest, stdout, stderr io.Writer) (ipc.ExecResult, error) {
	r, err := jsonRequest(http.MethodPost, "/v1/bg/logs", nil, req)
	if err != nil {
		return ipc.ExecResult{}, err
	}
	resp, err := c.roundTrip(ctx, r)
	if err != nil {
		return ipc.ExecResult{}, err
	}
	defer resp.Body.Close()
	return c.readExec(ctx, ndjsonFrames{json.NewDecoder(resp.Body)}, resp.StatusCode, ExecOptions{Stdout: stdout, Stderr: stderr}, nil)
}

// BgForward is POST /v1/bg/forward.
func (c *Client) BgForward(ctx context.Context, req ipc.BgForwardRequest) (ipc.BgProcess, error) {
	return call[ipc.BgProcess](ctx, c, http.MethodPost, "/v1/bg/forward", nil, req)
}

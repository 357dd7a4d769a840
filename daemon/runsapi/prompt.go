package runsapi

import (
	"context"
	"net/http"
	"net/url"

	"github.com/sandboxd/sandboxd/rwxapi"
)

// textAnswer receives a text body of at most max bytes (the rest is cut).
type textAnswer struct {
	max  int64
	body []byte
}

// MaxPromptBytes bounds the run summary RunPrompt returns.
const MaxPromptBytes = 16 << 10

// RunPrompt returns the remote's text summary of run runID (GET
// results/prompt): for a run whose setup failed, the failed task and the end
// of its output. It is text from the run (its commands' output): callers
// bound and clean it before showing it. token is a token scoped to the run;
// "" uses the client's own.
func (c *Client) RunPrompt(ctx context.Context, runID, token string) (string, error) {
	if runID == "" {
		return "", &APIError{Op: "run prompt", Status: http.StatusBadRequest, Message: "no run id given"}
	}
	res := &textAnswer{max: MaxPromptBytes}
	err := c.do(ctx, call{
		op: "run prompt", method: http.MethodGet, path: rwxapi.PathResultsPrompt,
		query: url.Values{"id": {runID}}, token: token, accept: "text/plain",
	}, res)
	return string(res.body), err
}

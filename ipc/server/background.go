package server

import (
	"context"
	"errors"
	"io"
	"net/http"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// BackgroundBackend runs managed background processes in sandboxes and owns
// their port forwards. The session backend provides it when it can (the
// server asks the SessionBackend for it), so fakes need not.
type BackgroundBackend interface {
	BgStart(ctx context.Context, req ipc.BgStartRequest) (ipc.BgProcess, error)
	BgRestart(ctx context.Context, req ipc.BgRequest) (ipc.BgProcess, error)
	BgStop(ctx context.Context, req ipc.BgRequest) (ipc.BgProcess, error)
	BgList(ctx context.Context, req ipc.BgListRequest) (ipc.BgListResponse, error)
	// BgLogs writes the process's logs to stdout and stderr; with Follow
	// it keeps following them until ctx ends.
	BgLogs(ctx context.Context, req ipc.BgRequest, stdout, stderr io.Writer) (ipc.BgProcess, error)
}

// BackgroundForwarder forwards a local port to a running background
// process without restarting it (POST /v1/bg/forward).
type BackgroundForwarder interface {
	BgForward(ctx context.Context, req ipc.BgForwardRequest) (ipc.BgProcess, error)
}

func (s *Server) forwarder() (BackgroundForwarder, error) {
	b, err := s.sessions()
	if err != nil {
		return nil, err
	}
	f, ok := b.(BackgroundForwarder)
	if !ok {
		return nil, errdefs.Unavailable(errors.New("forwarding to a running background process is not available in this daemon"))
	}
	return f, nil
}

func (s *Server) background() (BackgroundBackend, error) {
	b, err := s.sessions()
	if err != nil {
		return nil, err
	}
	bg, ok := b.(BackgroundBackend)
	if !ok {
		return nil, errdefs.Unavailable(errors.New("background processes are not available in this daemon"))
	}
	return bg, nil
}

func bgListQuery(r *http.Request) (ipc.BgListRequest, error) { return statusQuery(r) }

// listBg answers [] rather than null.
func listBg(b BackgroundBackend, ctx context.Context, req ipc.BgListRequest) (ipc.BgListResponse, error) {
	resp, err := b.BgList(ctx, req)
	if err == nil && resp.Processes == nil {
		resp.Processes = []ipc.BgProcess{}
	}
	return resp, err
}

// postBgLogs serves POST /v1/bg/logs: exec output frames (stdout, stderr)
// ending with exit (or error), like POST /v1/exec.
func (s *Server) postBgLogs(w http.ResponseWriter, r *http.Request) error {
	req, err := jsonBody[ipc.BgRequest](r)
	if err != nil {
		return err
	}
	b, err := s.background()
	if err != nil {
		return err
	}
	defer s.trackStream()()
	rc := http.NewResponseController(w)
	st := newExecStream(r.Context(), w, rc, false, s.log)
	proc, err := b.BgLogs(r.Context(), req, st.Stdout(), st.Stderr())
	if !st.finish(ipc.ExecResult{RunID: proc.RunID, PulledFiles: []string{}}, err) {
		return err // nothing streamed yet: a plain JSON error
	}
	return nil
}

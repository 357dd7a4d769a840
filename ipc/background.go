package ipc

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"

	"github.com/sandboxd/sandboxd/errdefs"
)

// BackgroundBackend runs managed background processes in sandboxes and owns
// their port forwards. The session backend provides it when it can (the
// server asks the SessionBackend for it), so fakes need not.
type BackgroundBackend interface {
	BgStart(ctx context.Context, req BgStartRequest) (BgProcess, error)
	BgRestart(ctx context.Context, req BgRequest) (BgProcess, error)
	BgStop(ctx context.Context, req BgRequest) (BgProcess, error)
	BgList(ctx context.Context, req BgListRequest) (BgListResponse, error)
	// BgLogs writes the process's logs to stdout and stderr; with Follow
	// it keeps following them until ctx ends.
	BgLogs(ctx context.Context, req BgRequest, stdout, stderr io.Writer) (BgProcess, error)
}

// BgStartRequest is POST /v1/bg/start: start (or replace) the background
// process Name running Argv in the sandbox, and with Port forward
// 127.0.0.1:LocalPort on this machine to the sandbox's loopback port.
type BgStartRequest struct {
	Target
	Name string   `json:"name"`
	Argv []string `json:"argv"`
	// Port is the sandbox port to forward (0: none); LocalPort the local
	// one (0: the one used before for this name, else any free port).
	Port      int  `json:"port,omitempty"`
	LocalPort int  `json:"localPort,omitempty"`
	NoSync    bool `json:"noSync,omitempty"`
}

// BgRequest names one background process: POST /v1/bg/restart, /v1/bg/stop
// and /v1/bg/logs.
type BgRequest struct {
	Target
	Name string `json:"name"`
	// Follow (logs only) keeps streaming new output.
	Follow bool `json:"follow,omitempty"`
}

// BgListRequest is GET /v1/bg?cwd=&configFile=&runId=.
type BgListRequest = Target

// BgListResponse lists the background processes sandboxd started in the
// sandbox, with their live status.
type BgListResponse struct {
	RunID     string      `json:"runId"`
	Processes []BgProcess `json:"processes"`
}

// BgProcess is a background process as the sandbox agent reports it, with
// its local forward.
type BgProcess struct {
	RunID       string   `json:"runId"`
	Name        string   `json:"name"`
	Status      string   `json:"status"` // running, exited, stopped, or unknown when the agent could not say
	Command     string   `json:"command,omitempty"`
	PID         int      `json:"pid,omitempty"`
	PGID        int      `json:"pgid,omitempty"`
	StartedAt   string   `json:"startedAt,omitempty"`
	CompletedAt string   `json:"completedAt,omitempty"`
	ExitCode    *int     `json:"exitCode,omitempty"`
	Signal      string   `json:"signal,omitempty"`
	StdoutPath  string   `json:"stdoutPath,omitempty"`
	StderrPath  string   `json:"stderrPath,omitempty"`
	Forward     *Forward `json:"forward,omitempty"`
	Detail      string   `json:"detail,omitempty"`
}

// Forward is a local port the daemon forwards to a sandbox port over its
// kept SSH connection.
type Forward struct {
	Name       string `json:"name"`
	LocalPort  int    `json:"localPort"`
	TargetPort int    `json:"targetPort"`
	URL        string `json:"url"`
	// State is "listening", or "failed" with Error saying why.
	State string `json:"state"`
	Error string `json:"error,omitempty"`
}

// maxBgName is the RWX CLI's limit on background process names.
const maxBgName = 255

func validBgName(name string) error {
	if name == "" {
		return errdefs.Invalidf("name is required: name the background process (--name web)")
	}
	if len(name) > maxBgName {
		return errdefs.Invalidf("name is longer than %d bytes", maxBgName)
	}
	for _, c := range name {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return errdefs.Invalidf("name %q may contain only letters, digits, '_' and '-'", name)
		}
	}
	return nil
}

func validPort(what string, p int) error {
	if p < 0 || p > 65535 {
		return errdefs.Invalidf("%s %d is not a port: give 1-65535", what, p)
	}
	return nil
}

// Validate checks a background start request.
func (r *BgStartRequest) Validate() error {
	if err := r.Target.Validate(); err != nil {
		return err
	}
	if err := validBgName(r.Name); err != nil {
		return err
	}
	if len(r.Argv) == 0 || r.Argv[0] == "" {
		return errdefs.Invalidf("argv is empty: give the command after --, for example `sbx bg start --name web --port 8000 -- python3 -m http.server 8000`")
	}
	for i, a := range r.Argv {
		if strings.ContainsRune(a, 0) {
			return errdefs.Invalidf("argv[%d] contains a NUL byte, which no command can receive", i)
		}
	}
	if err := validPort("port", r.Port); err != nil {
		return err
	}
	if err := validPort("localPort", r.LocalPort); err != nil {
		return err
	}
	if r.LocalPort != 0 && r.Port == 0 {
		return errdefs.Invalidf("localPort needs port: say which sandbox port to forward (--port)")
	}
	return nil
}

// Validate checks a request naming one background process.
func (r *BgRequest) Validate() error {
	if err := r.Target.Validate(); err != nil {
		return err
	}
	return validBgName(r.Name)
}

// Route paths of background processes.
const (
	routeBg        = "/v1/bg"
	routeBgStart   = "/v1/bg/start"
	routeBgRestart = "/v1/bg/restart"
	routeBgStop    = "/v1/bg/stop"
	routeBgLogs    = "/v1/bg/logs"
)

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

func bgListQuery(r *http.Request) (BgListRequest, error) { return statusQuery(r) }

// listBg answers [] rather than null.
func listBg(b BackgroundBackend, ctx context.Context, req BgListRequest) (BgListResponse, error) {
	resp, err := b.BgList(ctx, req)
	if err == nil && resp.Processes == nil {
		resp.Processes = []BgProcess{}
	}
	return resp, err
}

// postBgLogs serves POST /v1/bg/logs: exec output frames (stdout, stderr)
// ending with exit (or error), like POST /v1/exec.
func (s *Server) postBgLogs(w http.ResponseWriter, r *http.Request) error {
	req, err := jsonBody[BgRequest](r)
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
	if !st.finish(ExecResult{RunID: proc.RunID, PulledFiles: []string{}}, err) {
		return err // nothing streamed yet: a plain JSON error
	}
	return nil
}

package ipc

import (
	"strings"

	"github.com/sandboxd/sandboxd/errdefs"
)

// BgStartRequest is POST /v1/bg/start: start (or replace) the background
// process Name running Argv in the sandbox (no Argv: the process the
// sandbox config predefines under the key Name), and with Port forward
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
	// No argv: the process is predefined in the sandbox config under its
	// name (its key).
	if len(r.Argv) > 0 && r.Argv[0] == "" {
		return errdefs.Invalidf("argv[0] is empty: give the command after --, for example `nook bg start --name web --port 8000 -- python3 -m http.server 8000`")
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

// BgForwardRequest is POST /v1/bg/forward: forward 127.0.0.1:LocalPort on
// this machine to Port in the sandbox for the running process Name, without
// restarting it (Port 0: the process's own target port).
type BgForwardRequest struct {
	Target
	Name      string `json:"name"`
	Port      int    `json:"port,omitempty"`
	LocalPort int    `json:"localPort,omitempty"`
}

// Validate checks a forward request.
func (r *BgForwardRequest) Validate() error {
	if err := r.Target.Validate(); err != nil {
		return err
	}
	if err := validBgName(r.Name); err != nil {
		return err
	}
	if err := validPort("port", r.Port); err != nil {
		return err
	}
	return validPort("localPort", r.LocalPort)
}

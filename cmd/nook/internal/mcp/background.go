package mcp

import (
	"context"
	"errors"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/sandboxd/sandboxd/ipc"
)

// BgStartInput is the bg_start tool's input.
type BgStartInput struct {
	Where
	Name      string   `json:"name" jsonschema:"a name for the process (letters, digits, - and _), used by bg_logs, bg_restart and bg_stop; starting a name again replaces the process"`
	Command   string   `json:"command,omitempty" jsonschema:"a shell command line, run with sh -c, e.g. 'npm run dev'"`
	Argv      []string `json:"argv,omitempty" jsonschema:"the program and its arguments, passed exactly; give this or command"`
	Port      int      `json:"port,omitempty" jsonschema:"a port the process listens on in the sandbox, to forward to this machine (the answer says the local port)"`
	LocalPort int      `json:"localPort,omitempty" jsonschema:"the local port for the forward (default: the one used before for this name, else a free one)"`
	NoSync    bool     `json:"noSync,omitempty" jsonschema:"do not sync local changes to the sandbox first"`
}

// BgNameInput names one background process.
type BgNameInput struct {
	Where
	Name string `json:"name" jsonschema:"the process's name, as given to bg_start"`
}

// BgListInput is the bg_list tool's input.
type BgListInput struct {
	Where
}

// BgLogsOutput is the bg_logs tool's result.
type BgLogsOutput struct {
	Stdout          string `json:"stdout"`
	Stderr          string `json:"stderr"`
	StdoutTruncated bool   `json:"stdoutTruncated,omitempty"`
	StderrTruncated bool   `json:"stderrTruncated,omitempty"`
}

// addBackgroundTools registers the background-process tools.
func addBackgroundTools(s *sdk.Server, h *handlers) {
	sdk.AddTool(s, &sdk.Tool{
		Name:  "bg_start",
		Title: "Start a background process in the sandbox",
		Description: "Start a long-running process (a dev server, a watcher, a database) in the sandbox under a name, and return at once. " +
			"Local changes are synced first. With port, the sandbox port is forwarded to this machine (see forward.localPort in the answer); " +
			"like ssh -L, the forward listens on 127.0.0.1, where every local user can reach it. " +
			"Read its output with bg_logs; it keeps running between exec calls until bg_stop or the sandbox stops.",
		Annotations: changes(true, false),
	}, onSandbox(h, func(ctx context.Context, t ipc.Target, in BgStartInput) (ipc.BgProcess, error) {
		argv, err := commandArgv(in.Command, in.Argv)
		if err != nil {
			return ipc.BgProcess{}, err
		}
		return h.opts.Client.BgStart(ctx, ipc.BgStartRequest{Target: t, Name: in.Name, Argv: argv, Port: in.Port, LocalPort: in.LocalPort, NoSync: in.NoSync})
	}))
	sdk.AddTool(s, &sdk.Tool{
		Name:        "bg_list",
		Title:       "List background processes",
		Description: "List the background processes started in the sandbox with bg_start: name, status (running, exited, stopped), exit code, forward.",
		Annotations: readOnly(),
	}, onSandbox(h, func(ctx context.Context, t ipc.Target, _ BgListInput) (ipc.BgListResponse, error) {
		resp, err := h.opts.Client.BgList(ctx, t)
		if err == nil && resp.Processes == nil {
			resp.Processes = []ipc.BgProcess{}
		}
		return resp, err
	}))
	sdk.AddTool(s, &sdk.Tool{
		Name:        "bg_logs",
		Title:       "Read a background process's output",
		Description: "Return the stdout and stderr a background process wrote so far (cut to the output limit, keeping the start and the end). bg_list says whether it still runs and how it ended.",
		Annotations: readOnly(),
	}, onSandbox(h, func(ctx context.Context, t ipc.Target, in BgNameInput) (BgLogsOutput, error) {
		stdout, stderr := newCapture(h.opts.MaxOutput), newCapture(h.opts.MaxOutput)
		req, err := bgRequest(t, in)
		if err != nil {
			return BgLogsOutput{}, err
		}
		if _, err := h.opts.Client.BgLogs(ctx, req, stdout, stderr); err != nil {
			return BgLogsOutput{}, err
		}
		return BgLogsOutput{Stdout: stdout.String(), Stderr: stderr.String(), StdoutTruncated: stdout.truncated(), StderrTruncated: stderr.truncated()}, nil
	}))
	sdk.AddTool(s, &sdk.Tool{
		Name:        "bg_restart",
		Title:       "Restart a background process",
		Description: "Sync local changes and restart a background process with its command (its forward reopened).",
		Annotations: changes(true, false),
	}, onSandbox(h, func(ctx context.Context, t ipc.Target, in BgNameInput) (ipc.BgProcess, error) {
		req, err := bgRequest(t, in)
		if err != nil {
			return ipc.BgProcess{}, err
		}
		return h.opts.Client.BgRestart(ctx, req)
	}))
	sdk.AddTool(s, &sdk.Tool{
		Name:        "bg_stop",
		Title:       "Stop a background process",
		Description: "Stop a background process (its whole process group) and close its forward.",
		Annotations: changes(true, true),
	}, onSandbox(h, func(ctx context.Context, t ipc.Target, in BgNameInput) (ipc.BgProcess, error) {
		req, err := bgRequest(t, in)
		if err != nil {
			return ipc.BgProcess{}, err
		}
		return h.opts.Client.BgStop(ctx, req)
	}))
}

// bgRequest names one background process of the sandbox t.
func bgRequest(t ipc.Target, in BgNameInput) (ipc.BgRequest, error) {
	if in.Name == "" {
		return ipc.BgRequest{}, errors.New("name is required: the name given to bg_start (bg_list shows them)")
	}
	return ipc.BgRequest{Target: t, Name: in.Name}, nil
}

// Package mcp is `nook mcp`: a Model Context Protocol server over stdio that
// gives coding agents the sandbox as tools (exec, push, status, list,
// start, stop, reset, and the background-process tools). Every tool is one call on sandboxd's socket through
// ipc/client; the server holds no state besides its default directory.
package mcp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"
	"golang.org/x/sys/unix"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
)

// DefaultMaxOutput is the most bytes of stdout (and of stderr) an exec
// returns by default: enough for a test run's failures, small enough for an
// agent's context.
const DefaultMaxOutput = 32 << 10

// defaultWait bounds start and reset when the caller gives no timeout.
const defaultWait = 10 * time.Minute

// Options configure the server.
type Options struct {
	// Client talks to sandboxd.
	Client *client.Client
	// Dir is the directory a call means when it names none (the server's
	// cwd); relative directories in calls are taken from it.
	Dir string
	// MaxOutput bounds stdout and stderr of one exec (DefaultMaxOutput
	// when zero).
	MaxOutput int
	// Version is nook's version, announced to the client.
	Version string
	// Ensure is called before each tool call to make sure a daemon answers
	// (autostart); nil skips it.
	Ensure func(ctx context.Context) error
	// Checkout confines the server to the git checkout holding this
	// directory: a call naming another checkout (by cwd or runId) is
	// refused. Empty: the checkout holding Dir, if Dir is in one, unless
	// AnyCheckout.
	Checkout string
	// AnyCheckout lets calls reach every checkout on the machine.
	AnyCheckout bool
}

// NewServer returns the MCP server with the sandbox tools.
func NewServer(opts Options) *sdk.Server {
	if opts.MaxOutput <= 0 {
		opts.MaxOutput = DefaultMaxOutput
	}
	h := &handlers{opts: opts, confined: confinement(opts)}
	s := sdk.NewServer(&sdk.Implementation{Name: "nook", Title: "sandboxd", Version: opts.Version}, &sdk.ServerOptions{
		Instructions: instructions,
	})
	s.AddReceivingMiddleware(errorsSaid)
	sdk.AddTool(s, &sdk.Tool{
		Name:  "exec",
		Title: "Run a command in the sandbox",
		Description: "Run a command in the remote sandbox of a git checkout and return its exit code, stdout and stderr. " +
			"The sandbox is created (or reconnected) on first use. By default your uncommitted changes in the checkout are synced to the sandbox first, " +
			"and files the command changes in the sandbox come back to the checkout after (listed in pulledFiles). " +
			"Give either `command` (a shell command line, run by sh -c) or `argv` (a program and its arguments, passed exactly). " +
			"The command runs in the sandbox's directory that corresponds to cwd (root=true: at the checkout's root). " +
			sandboxHas +
			"Calls on one checkout run one after another; cancelling the call stops the remote command. " +
			fmt.Sprintf("stdout and stderr are each cut to %d bytes (keeping the start and the end) with a note saying how much was left out.", opts.MaxOutput),
		Annotations: changes(true, false),
	}, h.exec)
	sdk.AddTool(s, &sdk.Tool{
		Name:  "push",
		Title: "Sync local changes to the sandbox",
		Description: "Sync the checkout's uncommitted changes (and local commits the sandbox lacks) to its sandbox without running a command; " +
			"the sandbox is created (or reconnected) if needed. exec already does this before each command: call push when something else " +
			"reads the files, e.g. a background process started with bg_start that reloads on change, or an editor or shell on the sandbox. " +
			"Returns the files sent (files), whether commits were sent (commits), and pulledFiles: edits an earlier exec left in the sandbox, " +
			"copied back into the checkout first so that nothing is lost.",
		Annotations: changes(false, true),
	}, onSandbox(h, func(ctx context.Context, t ipc.Target, _ PushInput) (ipc.PushResponse, error) {
		return h.opts.Client.Push(ctx, t)
	}))
	sdk.AddTool(s, &sdk.Tool{
		Name:  "status",
		Title: "Probe the sandbox",
		Description: "Probe the sandbox of a checkout (or of a run id): probe is `connected` (ready for exec), `expired`, `no_sandbox` (none started yet; exec or start creates one) or `unknown`. " +
			"Also returns the session (run id, branch, config file, exec count) and its lifecycle.",
		Annotations: readOnly(),
	}, onSandbox(h, func(ctx context.Context, t ipc.Target, _ StatusInput) (ipc.ProbeResponse, error) {
		return h.opts.Client.Status(ctx, t)
	}))
	sdk.AddTool(s, &sdk.Tool{
		Name:        "list",
		Title:       "List sandboxes",
		Description: "List the sandboxes sandboxd knows on this machine (every checkout and branch), checked against the remote. With all=true, ended sandboxes and why they ended are included.",
		Annotations: readOnly(),
	}, h.list)
	sdk.AddTool(s, &sdk.Tool{
		Name:  "start",
		Title: "Start the sandbox",
		Description: "Start the sandbox of a checkout (its repository root, current branch and sandbox config), or report the one already active. " +
			"exec starts it by itself; call start ahead to have it ready. Waits until it is ready unless wait=false.",
		Annotations: changes(false, true),
	}, onSandbox(h, func(ctx context.Context, t ipc.Target, in StartInput) (ipc.StartResponse, error) {
		req, err := startRequest(t, in)
		if err != nil {
			return ipc.StartResponse{}, err
		}
		return h.opts.Client.Start(ctx, req)
	}))
	sdk.AddTool(s, &sdk.Tool{
		Name:        "stop",
		Title:       "Stop the sandbox",
		Description: "Stop (end) the sandbox of a checkout, or the run given by runId, or every sandbox with all=true. Idempotent. Work left only in the sandbox is lost: execs already synced it back.",
		Annotations: changes(true, true),
	}, h.stop)
	sdk.AddTool(s, &sdk.Tool{
		Name:  "reset",
		Title: "Replace the sandbox with a fresh one",
		Description: "Stop the sandbox of a checkout and start a new one, e.g. after changing the sandbox config (.rwx/sandbox.yml) or when the sandbox is in a bad state. " +
			"Waits until the new one is ready unless wait=false.",
		Annotations: changes(true, false),
	}, onSandbox(h, func(ctx context.Context, t ipc.Target, in StartInput) (ipc.StartResponse, error) {
		if in.RunID != "" {
			return ipc.StartResponse{}, errors.New("reset takes no runId: it replaces the sandbox of the checkout given by cwd")
		}
		req, err := startRequest(t, in)
		if err != nil {
			return ipc.StartResponse{}, err
		}
		return h.opts.Client.Reset(ctx, req)
	}))
	addBackgroundTools(s, h)
	return s
}

// sandboxHas says what a sandbox has, for the descriptions.
const sandboxHas = "A sandbox of the local remote (the default) has this machine's system toolchains read-only (/usr, /usr/local/go, /opt; not what lives in your home), " +
	"an empty home of its own, and the internet, but not this machine's network or its loopback services; " +
	"a sandbox on RWX Cloud has what the checkout's .rwx/sandbox.yml sets up. "

const instructions = `nook runs commands in a remote sandbox (an RWX sandbox run) for a git checkout on this machine, through the sandboxd daemon.
Use the exec tool to build, test or run anything in the sandbox: your uncommitted changes are synced to it first and its file changes come back after, so edit files locally and exec to run them.
The checkout is the directory given as "cwd" in each call (default: the directory this server was started in); exec runs the command in the sandbox's directory that corresponds to cwd (root: true runs it at the checkout's root).
` + sandboxHas

// Where is the part of every tool's input that picks the sandbox.
type Where struct {
	Cwd    string `json:"cwd,omitempty" jsonschema:"a directory inside the git checkout whose sandbox to use; relative to the server's directory, which is the default"`
	Config string `json:"config,omitempty" jsonschema:"the sandbox config file, relative to cwd (default: the nearest .rwx/sandbox.yml)"`
	RunID  string `json:"runId,omitempty" jsonschema:"a sandbox run id to use instead of the sandbox of the checkout (as listed by the list tool)"`
}

// ExecInput is the exec tool's input.
type ExecInput struct {
	Where
	Command string   `json:"command,omitempty" jsonschema:"a shell command line, run with sh -c in the sandbox's directory that corresponds to cwd, e.g. 'go test ./... 2>&1 | tail -50'"`
	Argv    []string `json:"argv,omitempty" jsonschema:"the program and its arguments, passed exactly (no shell), e.g. [\"make\", \"test\"]; give this or command"`
	NoSync  bool     `json:"noSync,omitempty" jsonschema:"do not sync local changes to the sandbox before, nor the sandbox's changes back after (default false: sync both ways)"`
	Stdin   string   `json:"stdin,omitempty" jsonschema:"text given to the command's standard input (default: empty)"`
	Root    bool     `json:"root,omitempty" jsonschema:"run at the root of the sandbox's checkout instead of the directory that corresponds to cwd (default false)"`
}

// ExecOutput is the exec tool's result.
type ExecOutput struct {
	ExitCode int    `json:"exitCode" jsonschema:"the command's exit status; 128+n when signal n ended it"`
	Signal   string `json:"signal,omitempty" jsonschema:"the signal that ended the command, if one did"`
	// The output is the text content's, not repeated here.
	Stdout          string   `json:"-"`
	Stderr          string   `json:"-"`
	StdoutTruncated bool     `json:"stdoutTruncated,omitempty" jsonschema:"stdout was longer than the limit; its middle was left out"`
	StderrTruncated bool     `json:"stderrTruncated,omitempty" jsonschema:"stderr was longer than the limit; its middle was left out"`
	PulledFiles     []string `json:"pulledFiles" jsonschema:"files the command changed in the sandbox, now copied back into the checkout"`
	RunID           string   `json:"runId"`
	DurationMs      int64    `json:"durationMs"`
	Warnings        []string `json:"warnings,omitempty"`
}

// where is the part of an input that picks the sandbox (every input
// embedding Where has it).
func (w Where) where() Where { return w }

// StatusInput is the status tool's input.
type StatusInput struct {
	Where
}

// PushInput is the push tool's input.
type PushInput struct {
	Where
}

// ListInput is the list tool's input.
type ListInput struct {
	All bool `json:"all,omitempty" jsonschema:"include ended sandboxes and why they ended"`
}

// StartInput is the start and reset tools' input.
type StartInput struct {
	Where
	Wait           *bool             `json:"wait,omitempty" jsonschema:"wait until the sandbox is ready (default true)"`
	TimeoutSeconds int               `json:"timeoutSeconds,omitempty" jsonschema:"how long to wait for the sandbox to be ready (default 600)"`
	Init           map[string]string `json:"init,omitempty" jsonschema:"init parameters of the run (KEY: VALUE)"`
}

// StopInput is the stop tool's input.
type StopInput struct {
	Where
	All bool `json:"all,omitempty" jsonschema:"stop every sandbox, not just the one of the checkout"`
}

type handlers struct {
	opts Options
	// confined is the repository root every call must stay in ("" when
	// the server may reach any checkout).
	confined string
	// runsInCheckout are the run ids found to be sandboxes of confined.
	runsInCheckout sync.Map
}

// target resolves the sandbox a call names, refusing one outside the
// checkout the server is confined to.
func (h *handlers) target(ctx context.Context, w Where) (ipc.Target, error) {
	t, err := h.where(w)
	if err != nil {
		return t, err
	}
	return t, h.allowed(ctx, t)
}

// where is the target a call names.
func (h *handlers) where(w Where) (ipc.Target, error) {
	dir := h.opts.Dir
	if w.Cwd != "" {
		dir = w.Cwd
		if !filepath.IsAbs(dir) {
			dir = filepath.Join(h.opts.Dir, dir)
		}
	}
	if dir == "" && w.RunID == "" {
		return ipc.Target{}, errors.New("no directory: pass cwd (an absolute path inside the git checkout)")
	}
	return ipc.Target{Cwd: filepath.Clean(dir), ConfigFile: w.Config, RunID: w.RunID}, nil
}

func (h *handlers) ensure(ctx context.Context) error {
	if h.opts.Ensure == nil {
		return nil
	}
	return h.opts.Ensure(ctx)
}

// sandbox resolves the sandbox a call names and makes sure a daemon
// answers: the start of every call on one sandbox.
func (h *handlers) sandbox(ctx context.Context, w Where) (ipc.Target, error) {
	if err := h.ensure(ctx); err != nil {
		return ipc.Target{}, err
	}
	return h.target(ctx, w)
}

// onSandbox is the handler of a tool that is one daemon call on the
// sandbox its input names, answered as JSON.
func onSandbox[In interface{ where() Where }, Out any](h *handlers, call func(context.Context, ipc.Target, In) (Out, error)) sdk.ToolHandlerFor[In, Out] {
	return func(ctx context.Context, req *sdk.CallToolRequest, in In) (*sdk.CallToolResult, Out, error) {
		t, err := h.sandbox(ctx, in.where())
		if err != nil {
			var zero Out
			return nil, zero, err
		}
		pr := newProgressRelay(req, h.opts.Client, t)
		pr.followStart(ctx)
		out, err := call(ctx, t, in)
		pr.done()
		return jsonResult(out, err)
	}
}

// readOnly annotates a tool that changes nothing.
func readOnly() *sdk.ToolAnnotations {
	return &sdk.ToolAnnotations{ReadOnlyHint: true, OpenWorldHint: new(bool)}
}

// changes annotates a tool that changes the sandbox (or the checkout).
func changes(destructive, idempotent bool) *sdk.ToolAnnotations {
	return &sdk.ToolAnnotations{DestructiveHint: &destructive, IdempotentHint: idempotent, OpenWorldHint: new(bool)}
}

func (h *handlers) exec(ctx context.Context, req *sdk.CallToolRequest, in ExecInput) (*sdk.CallToolResult, ExecOutput, error) {
	argv, err := commandArgv(in.Command, in.Argv)
	if err != nil {
		return nil, ExecOutput{}, err
	}
	t, err := h.sandbox(ctx, in.Where)
	if err != nil {
		return nil, ExecOutput{}, err
	}
	stdout, stderr := newCapture(h.opts.MaxOutput), newCapture(h.opts.MaxOutput)
	opts := client.ExecOptions{Stdout: stdout, Stderr: stderr}
	if pr := newProgressRelay(req, h.opts.Client, t); pr != nil {
		opts.OnFrame = pr.onFrame(ctx)
		defer pr.done()
	}
	if in.Stdin != "" {
		opts.Stdin = strings.NewReader(in.Stdin)
	}
	// Cancelling the MCP call cancels ctx, which disconnects the exec
	// stream: the daemon then stops the remote command.
	res, err := h.opts.Client.Exec(ctx, ipc.ExecRequest{Target: t, Argv: argv, NoSync: in.NoSync, Root: in.Root}, opts)
	if err != nil {
		return nil, ExecOutput{}, err
	}
	out := ExecOutput{
		ExitCode:        exitCode(res),
		Signal:          res.Signal,
		Stdout:          stdout.String(),
		Stderr:          stderr.String(),
		StdoutTruncated: stdout.truncated(),
		StderrTruncated: stderr.truncated(),
		PulledFiles:     res.PulledFiles,
		RunID:           res.RunID,
		DurationMs:      res.DurationMs,
		Warnings:        res.Warnings,
	}
	if out.PulledFiles == nil {
		out.PulledFiles = []string{}
	}
	return &sdk.CallToolResult{Content: []sdk.Content{&sdk.TextContent{Text: renderExec(out)}}}, out, nil
}

// commandArgv is the argv of a shell line or of an exact argv, one of them.
func commandArgv(command string, argv []string) ([]string, error) {
	switch {
	case command != "" && len(argv) > 0:
		return nil, errors.New("give either command (a shell line) or argv (a program and its arguments), not both")
	case command != "":
		return []string{"sh", "-c", command}, nil
	case len(argv) > 0:
		return argv, nil
	}
	return nil, errors.New("nothing to run: give command (a shell line, e.g. \"make test\") or argv (e.g. [\"make\", \"test\"])")
}

// renderExec is the exec result as text, for clients that show text only.
func renderExec(o ExecOutput) string {
	var b strings.Builder
	fmt.Fprintf(&b, "exit code: %d", o.ExitCode)
	if o.Signal != "" {
		fmt.Fprintf(&b, " (signal %s)", o.Signal)
	}
	b.WriteString("\n")
	for _, w := range o.Warnings {
		fmt.Fprintf(&b, "warning: %s\n", w)
	}
	if len(o.PulledFiles) > 0 {
		fmt.Fprintf(&b, "files changed in the sandbox, copied back: %s\n", strings.Join(o.PulledFiles, ", "))
	}
	section := func(name, s string) {
		if s == "" {
			fmt.Fprintf(&b, "%s: (empty)\n", name)
			return
		}
		fmt.Fprintf(&b, "%s:\n%s", name, s)
		if !strings.HasSuffix(s, "\n") {
			b.WriteString("\n")
		}
	}
	section("stdout", o.Stdout)
	section("stderr", o.Stderr)
	return b.String()
}

// exitCode is the shell's view of a result: its status, or 128+n for a
// signal (as nook exec exits).
func exitCode(res ipc.ExecResult) int {
	if res.Signal != "" {
		if n := unix.SignalNum("SIG" + res.Signal); n > 0 {
			return 128 + int(n)
		}
	}
	return res.ExitCode
}

func (h *handlers) list(ctx context.Context, _ *sdk.CallToolRequest, in ListInput) (*sdk.CallToolResult, ipc.ListResponse, error) {
	if err := h.ensure(ctx); err != nil {
		return nil, ipc.ListResponse{}, err
	}
	resp, err := h.opts.Client.List(ctx, ipc.ListRequest{All: in.All})
	if err == nil && h.confined != "" {
		mine := resp.Sessions[:0]
		for _, s := range resp.Sessions {
			if sameDir(s.RepoRoot, h.confined) {
				mine = append(mine, s)
			}
		}
		resp.Sessions = mine
	}
	if err == nil && resp.Sessions == nil {
		resp.Sessions = []ipc.SessionInfo{}
	}
	return jsonResult(resp, err)
}

// startRequest is the request of a start or reset call.
func startRequest(t ipc.Target, in StartInput) (ipc.StartRequest, error) {
	if in.TimeoutSeconds < 0 {
		return ipc.StartRequest{}, errors.New("timeoutSeconds is negative: give a number of seconds, or leave it out for 600")
	}
	wait := in.Wait == nil || *in.Wait
	timeout := in.TimeoutSeconds
	if wait && timeout == 0 {
		timeout = int(defaultWait / time.Second)
	}
	return ipc.StartRequest{Target: t, Wait: wait, Init: in.Init, WaitTimeoutSeconds: timeout}, nil
}

func (h *handlers) stop(ctx context.Context, _ *sdk.CallToolRequest, in StopInput) (*sdk.CallToolResult, ipc.StopResponse, error) {
	req := ipc.StopRequest{All: in.All}
	if in.All && h.confined != "" {
		return nil, ipc.StopResponse{}, h.outside("all=true")
	}
	if err := h.ensure(ctx); err != nil {
		return nil, ipc.StopResponse{}, err
	}
	if !in.All {
		t, err := h.target(ctx, in.Where)
		if err != nil {
			return nil, ipc.StopResponse{}, err
		}
		req.Target = t
	}
	resp, err := h.opts.Client.Stop(ctx, req)
	if err == nil && resp.Stopped == nil {
		resp.Stopped = []ipc.SessionInfo{}
	}
	return jsonResult(resp, err)
}

// jsonResult answers a tool with its response as indented JSON text (and,
// through the SDK, as structured content).
func jsonResult[T any](v T, err error) (*sdk.CallToolResult, T, error) {
	if err != nil {
		var zero T
		return nil, zero, err
	}
	b, merr := json.MarshalIndent(v, "", "  ")
	if merr != nil {
		var zero T
		return nil, zero, fmt.Errorf("encode the answer: %w", merr)
	}
	return &sdk.CallToolResult{Content: []sdk.Content{&sdk.TextContent{Text: string(b)}}}, v, nil
}

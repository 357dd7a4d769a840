package cli

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/sandboxd/sandboxd/ipc"
)

// bgCommand is `nook bg`: managed background processes in the sandbox and
// the daemon's port forwards to them.
func bgCommand() *command {
	name := func() []flagSpec { return []flagSpec{idFlag(), keyFlag()} }
	return &command{name: "bg", summary: "run background processes in the sandbox, with local port forwards",
		long: "A background process runs in the sandbox in its own process group, logging to files, until it is " +
			"stopped or the sandbox ends. With --port, sandboxd forwards 127.0.0.1:LOCAL on this machine to that " +
			"port on the sandbox's loopback over its kept SSH connection: the forward outlives nook, comes back " +
			"after a reconnect or a daemon restart, and is closed when the sandbox stops. Like `ssh -L`, the forward is " +
			"reachable by every local user of this machine, not only by you (docs/sessions.md).",
		subs: []*command{
			{name: "start", args: "[-- CMD [ARG...]]", argv: true, argvOptional: true, autoStart: true, run: (*app).bgStart,
				summary: "sync your changes, then start (or replace) a named background process (without a command: the one the config predefines under its key)",
				flags: []flagSpec{idFlag(),
					{name: "name", kind: stringFlag, arg: "NAME", compl: complNone, help: "the process's name (letters, digits, _ and -)"},
					keyFlag(),
					{name: "port", kind: stringFlag, arg: "PORT", compl: complNone, help: "a sandbox port to forward to this machine"},
					{name: "local-port", kind: stringFlag, arg: "PORT", compl: complNone, help: "the local port (default: the previous one of NAME, else a free one)"},
					{name: "no-sync", kind: boolFlag, help: "do not sync local changes to the sandbox first"},
				}},
			{name: "list", autoStart: true, run: (*app).bgList, flags: name(),
				summary: "list the sandbox's background processes (nook's and the RWX CLI's), their status and forwards"},
			{name: "stop", args: "NAME", maxArgs: 1, autoStart: true, run: (*app).bgStop, flags: name(),
				summary: "stop a background process (its whole process group) and close its forward"},
			{name: "restart", args: "NAME", maxArgs: 1, autoStart: true, run: (*app).bgRestart, flags: name(),
				summary: "sync your changes, then restart a background process with its command"},
			{name: "logs", args: "NAME", maxArgs: 1, autoStart: true, run: (*app).bgLogs,
				summary: "print a background process's stdout and stderr",
				flags:   []flagSpec{idFlag(), keyFlag(), {name: "follow", short: "f", kind: boolFlag, help: "keep printing new output until Ctrl-C"}}},
			forwardCommand("forward"),
		}}
}

// keyFlag is --key, RWX's name for a background process's name (--name).
func keyFlag() flagSpec {
	return flagSpec{name: "key", kind: stringFlag, arg: "KEY", compl: complNone, help: "the process's key: the same as its name"}
}

// forwardCommand is `nook bg forward` (and `nook forward`): a forward to a
// process that already runs, as `rwx sandbox tunnel`.
func forwardCommand(name string) *command {
	return &command{name: name, args: "[KEY]", maxArgs: 1, autoStart: true, run: (*app).bgForward,
		summary: "forward a local port to a running background process, without restarting it",
		flags: []flagSpec{idFlag(), keyFlag(),
			{name: "port", kind: stringFlag, arg: "PORT", compl: complNone, help: "the sandbox port (default: the process's own)"},
			{name: "local-port", kind: stringFlag, arg: "PORT", compl: complNone, help: "the local port (default: the previous one of KEY, else a free one)"},
		}}
}

func (a *app) bgForward(ctx context.Context) int {
	t, err := a.bgTarget()
	if err != nil {
		return a.fail(err)
	}
	name, ok := a.bgName()
	if !ok {
		return a.usage(&usageError{cmd: a.p.cmd, msg: "give the key of the running background process: --key KEY"})
	}
	req := ipc.BgForwardRequest{Target: t, Name: name}
	if req.Port, err = a.portFlag("port"); err != nil {
		return a.usage(err)
	}
	if req.LocalPort, err = a.portFlag("local-port"); err != nil {
		return a.usage(err)
	}
	var p ipc.BgProcess
	if err := a.call(ctx, func(ctx context.Context) (err error) { p, err = a.c.BgForward(ctx, req); return err }); err != nil {
		return a.fail(err)
	}
	if a.p.json() {
		return a.printJSON(p)
	}
	if p.Forward != nil {
		fmt.Fprintf(a.sys.Stdout, "Forwarding %s to port %d of background process %q in %s.\n", p.Forward.URL, p.Forward.TargetPort, p.Name, p.RunID)
	}
	if p.Detail != "" {
		a.warn(p.Detail)
	}
	return ExitOK
}

// bgTarget is the sandbox of this checkout, or --id.
func (a *app) bgTarget() (ipc.Target, error) {
	cwd, err := a.cwd()
	if err != nil {
		return ipc.Target{}, err
	}
	return ipc.Target{Cwd: cwd, RunID: a.p.strings["id"]}, nil
}

// bgName is the NAME argument of stop, restart, logs and forward, or
// their --key (RWX's word for it).
func (a *app) bgName() (string, bool) {
	key := a.p.strings["key"]
	switch {
	case len(a.p.args) == 1 && a.p.args[0] != "" && (key == "" || key == a.p.args[0]):
		return a.p.args[0], true
	case len(a.p.args) == 0 && key != "":
		return key, true
	}
	return "", false
}

func (a *app) portFlag(flag string) (int, error) {
	s := a.p.strings[flag]
	if s == "" {
		return 0, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > 65535 {
		return 0, &usageError{cmd: a.p.cmd, msg: fmt.Sprintf("--%s %q is not a port: give 1-65535", flag, s)}
	}
	return n, nil
}

func (a *app) bgStart(ctx context.Context) int {
	t, err := a.bgTarget()
	if err != nil {
		return a.fail(err)
	}
	req := ipc.BgStartRequest{Target: t, Name: a.p.strings["name"], Argv: a.p.argv, NoSync: a.p.bools["no-sync"]}
	if key := a.p.strings["key"]; key != "" {
		if req.Name != "" && req.Name != key {
			return a.usage(&usageError{cmd: a.p.cmd, msg: "--name and --key name the same thing: give one"})
		}
		req.Name = key
	}
	if req.Name == "" {
		return a.usage(&usageError{cmd: a.p.cmd, msg: "--name (or --key) is required: name the process, for example `nook bg start --name web --port 8000 -- python3 -m http.server 8000`, or give the key of a process the sandbox config predefines"})
	}
	if req.Port, err = a.portFlag("port"); err != nil {
		return a.usage(err)
	}
	if req.LocalPort, err = a.portFlag("local-port"); err != nil {
		return a.usage(err)
	}
	if req.LocalPort != 0 && req.Port == 0 {
		return a.usage(&usageError{cmd: a.p.cmd, msg: "--local-port needs --port: say which sandbox port to forward"})
	}
	var p ipc.BgProcess
	stop := a.portWaitProgress(req.Name, req.Port)
	err = a.call(ctx, func(ctx context.Context) (err error) { p, err = a.c.BgStart(ctx, req); return err })
	stop()
	if err != nil {
		return a.fail(err)
	}
	return a.bgStarted(p, "Started")
}

func (a *app) bgRestart(ctx context.Context) int {
	t, err := a.bgTarget()
	if err != nil {
		return a.fail(err)
	}
	name, ok := a.bgName()
	if !ok {
		return a.usage(&usageError{cmd: a.p.cmd, msg: "give the name of the background process to restart"})
	}
	var p ipc.BgProcess
	req := ipc.BgRequest{Target: t, Name: name}
	if err := a.call(ctx, func(ctx context.Context) (err error) { p, err = a.c.BgRestart(ctx, req); return err }); err != nil {
		return a.fail(err)
	}
	return a.bgStarted(p, "Restarted")
}

func (a *app) bgStarted(p ipc.BgProcess, verb string) int {
	if a.p.json() {
		return a.printJSON(p)
	}
	fmt.Fprintf(a.sys.Stdout, "%s background process %q (pid %d) in %s.\n", verb, p.Name, p.PID, p.RunID)
	if p.Forward != nil {
		fmt.Fprintf(a.sys.Stdout, "Forwarding %s to port %d in the sandbox.\n", p.Forward.URL, p.Forward.TargetPort)
	}
	if p.Detail != "" {
		a.warn(p.Detail)
	}
	fmt.Fprintf(a.sys.Stdout, "Logs: nook bg logs -f %s; after local edits: nook bg restart %s\n", p.Name, p.Name)
	return ExitOK
}

func (a *app) bgStop(ctx context.Context) int {
	t, err := a.bgTarget()
	if err != nil {
		return a.fail(err)
	}
	name, ok := a.bgName()
	if !ok {
		return a.usage(&usageError{cmd: a.p.cmd, msg: "give the name of the background process to stop"})
	}
	var p ipc.BgProcess
	req := ipc.BgRequest{Target: t, Name: name}
	if err := a.call(ctx, func(ctx context.Context) (err error) { p, err = a.c.BgStop(ctx, req); return err }); err != nil {
		return a.fail(err)
	}
	if a.p.json() {
		return a.printJSON(p)
	}
	fmt.Fprintf(a.sys.Stdout, "Stopped background process %q (%s).\n", p.Name, bgStatus(p))
	return ExitOK
}

func bgStatus(p ipc.BgProcess) string {
	s := p.Status
	switch {
	case p.Signal != "":
		s += ", signal " + p.Signal
	case p.ExitCode != nil:
		s += ", exit " + strconv.Itoa(*p.ExitCode)
	}
	return s
}

func (a *app) bgList(ctx context.Context) int {
	t, err := a.bgTarget()
	if err != nil {
		return a.fail(err)
	}
	var resp ipc.BgListResponse
	if err := a.call(ctx, func(ctx context.Context) (err error) { resp, err = a.c.BgList(ctx, t); return err }); err != nil {
		return a.fail(err)
	}
	if a.p.json() {
		return a.printJSON(resp)
	}
	if len(resp.Processes) == 0 {
		fmt.Fprintln(a.sys.Stdout, "No background processes. Start one with `nook bg start --name NAME [--port PORT] -- CMD`.")
		return ExitOK
	}
	tw := tabwriter.NewWriter(a.sys.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tSTATUS\tPID\tFORWARD\tCOMMAND")
	for _, p := range resp.Processes {
		fwd := "-"
		if f := p.Forward; f != nil {
			fwd = fmt.Sprintf("%s -> %d", f.URL, f.TargetPort)
			if f.State != "listening" {
				fwd += " (" + f.State + ": " + f.Error + ")"
			}
		}
		pid := "-"
		if p.PID != 0 {
			pid = strconv.Itoa(p.PID)
		}
		status := bgStatus(p)
		if p.Detail != "" {
			status += " (" + p.Detail + ")"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", p.Name, status, pid, fwd, strings.ReplaceAll(p.Command, "\n", " "))
	}
	tw.Flush()
	return ExitOK
}

func (a *app) bgLogs(ctx context.Context) int {
	t, err := a.bgTarget()
	if err != nil {
		return a.fail(err)
	}
	name, ok := a.bgName()
	if !ok {
		return a.usage(&usageError{cmd: a.p.cmd, msg: "give the name of the background process whose logs to show"})
	}
	req := ipc.BgRequest{Target: t, Name: name, Follow: a.p.bools["follow"]}
	if req.Follow {
		var stop func()
		ctx, stop = a.interruptContext(ctx)
		defer stop()
	}
	stdout, stderr := a.sys.Stdout, a.sys.Stderr
	if a.p.json() {
		// JSON lines: {"stream":"stdout","data":"..."}.
		stdout, stderr = jsonLines{a, "stdout"}, jsonLines{a, "stderr"}
	}
	if err := a.call(ctx, func(ctx context.Context) error { _, err := a.c.BgLogs(ctx, req, stdout, stderr); return err }); err != nil {
		if req.Follow && ctx.Err() != nil {
			return ExitOK // the user stopped following
		}
		return a.fail(err)
	}
	return ExitOK
}

// jsonLines prints each write as one JSON line naming its stream.
type jsonLines struct {
	a      *app
	stream string
}

func (j jsonLines) Write(p []byte) (int, error) {
	j.a.printJSON(map[string]string{"stream": j.stream, "data": string(p)})
	return len(p), nil
}

// portWaitFirst and portWaitEvery pace the lines bg start prints while
// the daemon waits (up to 30s) for the process's port to open.
const (
	portWaitFirst = 2 * time.Second
	portWaitEvery = 5 * time.Second
)

// portWaitProgress says, on stderr, that bg start is still waiting for
// port to open in the sandbox, once the answer is late and then every few
// seconds, until the returned function is called.
func (a *app) portWaitProgress(name string, port int) func() {
	if port == 0 || a.p.quiet() {
		return func() {}
	}
	done := make(chan struct{})
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		start := time.Now()
		t := time.NewTimer(portWaitFirst)
		defer t.Stop()
		for first := true; ; first = false {
			select {
			case <-done:
				return
			case <-t.C:
			}
			if first {
				fmt.Fprintf(a.sys.Stderr, "nook: starting %q and waiting for port %d to open in the sandbox (up to 30s)\n", name, port)
			} else {
				fmt.Fprintf(a.sys.Stderr, "nook: still waiting for port %d (%ds); `nook bg logs %s` shows what the process says\n", port, int(time.Since(start).Seconds()), name)
			}
			t.Reset(portWaitEvery)
		}
	}()
	return func() {
		close(done)
		<-exited
	}
}

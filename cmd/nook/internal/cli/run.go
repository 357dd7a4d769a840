package cli

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
)

// versionJSON is `nook version --json`.
type versionJSON struct {
	Client   clientVersion       `json:"client"`
	Daemon   ipc.VersionResponse `json:"daemon"`
	Mismatch bool                `json:"mismatch"`
}

// clientVersion is nook's own version: a short-lived process has no pid or
// start time worth reporting.
type clientVersion struct {
	Version   string `json:"version"`
	GoVersion string `json:"goVersion"`
}

func (a *app) version(ctx context.Context) int {
	var d ipc.VersionResponse
	err := a.call(ctx, func(ctx context.Context) (err error) { d, err = a.c.Version(ctx); return err })
	if err != nil {
		return a.fail(err)
	}
	mismatch := d.Version != a.sys.Version
	if mismatch {
		a.warn(fmt.Sprintf("nook %s and sandboxd %s differ: restart the daemon (nook daemon stop) so that both come from the same build", a.sys.Version, d.Version))
	}
	if a.p.json() {
		return a.printJSON(versionJSON{Client: clientVersion{Version: a.sys.Version, GoVersion: runtime.Version()}, Daemon: d, Mismatch: mismatch})
	}
	fmt.Fprintf(a.sys.Stdout, "nook       %s (%s)\nsandboxd  %s (%s, pid %d, up %s)\n", a.sys.Version, runtime.Version(),
		d.Version, d.GoVersion, d.PID, a.sys.Now().Sub(d.StartedAt).Round(time.Second))
	return ExitOK
}

// daemonStatusJSON is `nook daemon status --json`.
type daemonStatusJSON struct {
	Running bool                `json:"running"`
	Socket  string              `json:"socket"`
	Version string              `json:"version,omitempty"`
	Health  *ipc.HealthResponse `json:"health,omitempty"`
	Error   string              `json:"error,omitempty"`
}

func (a *app) daemonStatus(ctx context.Context) int {
	out := daemonStatusJSON{Socket: a.layout.Socket}
	h, err := a.c.Health(ctx)
	switch {
	case errors.Is(err, client.ErrDaemonNotRunning):
		if a.p.json() {
			a.printJSON(out)
		} else {
			fmt.Fprintf(a.sys.Stdout, "sandboxd is not running (socket %s)\n", a.layout.Socket)
		}
		return ExitNotRunning
	case err != nil:
		return a.fail(err)
	}
	out.Running, out.Version, out.Health = true, a.c.DaemonVersion(), &h
	if a.p.json() {
		return a.printJSON(out)
	}
	tw := tabwriter.NewWriter(a.sys.Stdout, 0, 0, 2, ' ', 0)
	state := h.Status
	if h.Config != "" && h.Config != "ok" {
		state += ", but its config file has errors"
	}
	fmt.Fprintf(tw, "sandboxd\trunning (%s), version %s, up %s\n", state, out.Version, (time.Duration(h.UptimeSeconds) * time.Second).String())
	if h.Config != "" && h.Config != "ok" {
		fmt.Fprintf(tw, "config\t%s\n", h.Config)
	}
	fmt.Fprintf(tw, "socket\t%s%s\n", a.layout.Socket, map[bool]string{true: " (socket-activated)"}[h.Activated])
	fmt.Fprintf(tw, "store\t%s (%s)\n", h.Store, h.Database)
	fmt.Fprintf(tw, "sessions\t%d, %d connected, %d open streams\n", h.Sessions, h.Connections, h.LiveStreams)
	tw.Flush()
	return ExitOK
}

func (a *app) daemonStop(ctx context.Context) int {
	err := a.c.StopDaemon(ctx)
	if errors.Is(err, client.ErrDaemonNotRunning) {
		if a.p.json() {
			return a.printJSON(map[string]any{"stopped": false, "running": false})
		}
		fmt.Fprintln(a.sys.Stdout, "sandboxd is not running")
		return ExitOK
	}
	if err != nil {
		return a.fail(err)
	}
	// Wait until the socket stops answering, so that the next command
	// does not reach the daemon that is going away.
	deadline := a.sys.Now().Add(30 * time.Second)
	for {
		_, err := a.c.Version(ctx)
		if errors.Is(err, client.ErrDaemonNotRunning) {
			break
		}
		if a.sys.Now().After(deadline) {
			return a.fail(errors.New("sandboxd accepted the stop request but still answers after 30s: commands in flight may be holding it; see its log"))
		}
		select {
		case <-ctx.Done():
			return a.fail(ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	if a.p.json() {
		return a.printJSON(map[string]any{"stopped": true, "running": false})
	}
	fmt.Fprintln(a.sys.Stdout, "sandboxd stopped")
	return ExitOK
}

func (a *app) config(ctx context.Context) int {
	var cfg ipc.ConfigResponse
	if err := a.call(ctx, func(ctx context.Context) (err error) { cfg, err = a.c.Config(ctx); return err }); err != nil {
		return a.fail(err)
	}
	if a.p.json() {
		return a.printJSON(cfg)
	}
	tw := tabwriter.NewWriter(a.sys.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "remote\t%s\nhost\t%s\n", cfg.Remote, cfg.Host)
	if cfg.TokenSource != "" {
		fmt.Fprintf(tw, "token from\t%s\n", cfg.TokenSource)
	}
	if cfg.CertFile != "" {
		fmt.Fprintf(tw, "certificate\t%s\n", cfg.CertFile)
	}
	fmt.Fprintf(tw, "config file\t%s\n", cfg.ConfigFile)
	if cfg.IdleStopSeconds > 0 {
		fmt.Fprintf(tw, "idle stop after\t%s\n", time.Duration(cfg.IdleStopSeconds*float64(time.Second)))
	} else {
		fmt.Fprintf(tw, "idle stop\tnone\n")
	}
	if cfg.ReconcileIntervalSeconds > 0 {
		fmt.Fprintf(tw, "reconcile every\t%s\n", time.Duration(cfg.ReconcileIntervalSeconds*float64(time.Second)))
	}
	tw.Flush()
	return ExitOK
}

// startRequest builds start and reset requests from the flags.
func (a *app) startRequest() (ipc.StartRequest, error) {
	t, err := a.target()
	if err != nil {
		return ipc.StartRequest{}, err
	}
	req := ipc.StartRequest{Target: t, Wait: a.p.bools["wait"], Discard: a.p.bools["discard"]}
	if s := a.p.strings["timeout"]; s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d <= 0 {
			return req, &usageError{cmd: a.p.cmd, msg: fmt.Sprintf("--timeout %q is not a positive duration (for example 5m)", s)}
		}
		req.WaitTimeoutSeconds = int((d + time.Second - 1) / time.Second)
	}
	for _, kv := range a.p.lists["init"] {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || strings.TrimSpace(k) == "" {
			return req, &usageError{cmd: a.p.cmd, msg: fmt.Sprintf("--init %q is not KEY=VALUE", kv)}
		}
		if req.Init == nil {
			req.Init = map[string]string{}
		}
		req.Init[k] = v
	}
	return req, nil
}

func (a *app) start(ctx context.Context) int { return a.startOrReset(ctx, false) }
func (a *app) reset(ctx context.Context) int { return a.startOrReset(ctx, true) }

func (a *app) startOrReset(ctx context.Context, reset bool) int {
	req, err := a.startRequest()
	if err != nil {
		return a.usage(err)
	}
	var resp ipc.StartResponse
	err = a.call(ctx, func(ctx context.Context) (err error) {
		// The phases of the start, as the daemon publishes them, until
		// the answer (a daemon that is not running has no events yet:
		// this runs again after autostart).
		stop := a.followProgress(ctx, a.prog, nil, a.sys.Now())
		defer func() { stop(); a.prog.done() }()
		if reset {
			resp, err = a.c.Reset(ctx, req)
		} else {
			resp, err = a.c.Start(ctx, req)
		}
		return err
	})
	if err != nil {
		return a.fail(err)
	}
	for _, w := range resp.Warnings {
		a.warn(w)
	}
	if resp.Edits != nil {
		a.endEdits(*resp.Edits)
	}
	if a.p.json() {
		return a.printJSON(resp)
	}
	s := resp.Session
	switch {
	case reset && resp.Replaced != "":
		fmt.Fprintf(a.sys.Stdout, "Stopped %s; started %s (%s)%s\n", resp.Replaced, s.RunID, s.Status, spaced(s.RunURL))
	case resp.Created:
		fmt.Fprintf(a.sys.Stdout, "Started sandbox %s (%s)%s\n", s.RunID, s.Status, spaced(s.RunURL))
	default:
		fmt.Fprintf(a.sys.Stdout, "Sandbox %s is already active for this checkout (%s)%s\nUse `nook reset` to replace it.\n", s.RunID, s.Status, spaced(s.RunURL))
	}
	return ExitOK
}

func (a *app) list(ctx context.Context) int {
	var resp ipc.ListResponse
	req := ipc.ListRequest{All: a.p.bools["all"]}
	if err := a.call(ctx, func(ctx context.Context) (err error) { resp, err = a.c.List(ctx, req); return err }); err != nil {
		return a.fail(err)
	}
	for _, w := range resp.Warnings {
		a.warn(w)
	}
	if a.p.json() {
		if resp.Sessions == nil {
			resp.Sessions = []ipc.SessionInfo{}
		}
		return a.printJSON(resp)
	}
	if len(resp.Sessions) == 0 {
		fmt.Fprintln(a.sys.Stdout, "No sandboxes. Start one with `nook start` or `nook exec -- CMD`.")
		return ExitOK
	}
	tw := tabwriter.NewWriter(a.sys.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "RUN\tSTATUS\tREPOSITORY\tBRANCH\tCONFIG\tLAST EXEC\tIDLE\tIDLE STOP\tEXPIRES")
	for _, s := range resp.Sessions {
		status := s.Status
		if s.Reason != "" && a.p.bools["all"] {
			status += " (" + s.Reason + ")"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", s.RunID, status, s.RepoRoot, s.Branch, relConfig(s), a.ago(s.LastExecAt), idleColumn(s), a.stopColumn(s), a.expiresColumn(s))
	}
	tw.Flush()
	for _, s := range resp.Sessions {
		for _, f := range s.Forwards {
			line := fmt.Sprintf("%s forward %s: %s -> sandbox port %d", s.RunID, f.Name, f.URL, f.TargetPort)
			if f.State != "listening" {
				line += " (" + f.State + ": " + f.Error + ")"
			}
			fmt.Fprintln(a.sys.Stdout, line)
		}
	}
	return ExitOK
}

// relConfig shows a session's config relative to its repository.
func relConfig(s ipc.SessionInfo) string {
	if rel, err := filepath.Rel(s.RepoRoot, s.ConfigFile); err == nil && !strings.HasPrefix(rel, "..") {
		return rel
	}
	return s.ConfigFile
}

func (a *app) ago(t *time.Time) string {
	if t == nil || t.IsZero() {
		return "-"
	}
	d := a.sys.Now().Sub(*t)
	switch {
	case d < time.Minute:
		return strconv.Itoa(int(d/time.Second)) + "s ago"
	case d < time.Hour:
		return strconv.Itoa(int(d/time.Minute)) + "m ago"
	case d < 48*time.Hour:
		return strconv.Itoa(int(d/time.Hour)) + "h ago"
	}
	return t.Local().Format("2006-01-02")
}

func (a *app) stop(ctx context.Context) int {
	req := ipc.StopRequest{All: a.p.bools["all"], Discard: a.p.bools["discard"]}
	if !req.All {
		t, err := a.target()
		if err != nil {
			return a.fail(err)
		}
		req.Target = t
	} else if a.p.strings["id"] != "" || len(a.p.args) > 0 {
		return a.usage(&usageError{cmd: a.p.cmd, msg: "--all stops every sandbox: give either --all or --id/config, not both"})
	}
	var resp ipc.StopResponse
	err := a.call(ctx, func(ctx context.Context) (err error) {
		// A stop waits for a running command before pulling: the daemon
		// says so as progress.
		stop := a.followProgress(ctx, a.prog, nil, a.sys.Now())
		defer func() { stop(); a.prog.done() }()
		resp, err = a.c.Stop(ctx, req)
		return err
	})
	for _, e := range resp.Edits {
		a.endEdits(e)
	}
	if err != nil {
		return a.fail(err)
	}
	if a.p.json() {
		if resp.Stopped == nil {
			resp.Stopped = []ipc.SessionInfo{}
		}
		return a.printJSON(resp)
	}
	if len(resp.Stopped) == 0 {
		fmt.Fprintln(a.sys.Stdout, "No active sandbox to stop.")
	}
	for _, s := range resp.Stopped {
		fmt.Fprintf(a.sys.Stdout, "Stopped %s (%s, %s)\n", s.RunID, s.Branch, s.Status)
	}
	return ExitOK
}

func (a *app) init(ctx context.Context) int {
	cwd, err := a.cwd()
	if err != nil {
		return a.fail(err)
	}
	req := ipc.InitRequest{Cwd: cwd}
	if len(a.p.args) > 0 {
		req.File = a.p.args[0]
	}
	var resp ipc.InitResponse
	if err := a.call(ctx, func(ctx context.Context) (err error) { resp, err = a.c.Init(ctx, req); return err }); err != nil {
		return a.fail(err)
	}
	if a.p.json() {
		return a.printJSON(resp)
	}
	fmt.Fprintf(a.sys.Stdout, "Wrote %s\n", resp.File)
	return ExitOK
}

func (a *app) status(ctx context.Context) int {
	t, err := a.target()
	if err != nil {
		return a.fail(err)
	}
	var resp ipc.ProbeResponse
	if err := a.call(ctx, func(ctx context.Context) (err error) { resp, err = a.c.Status(ctx, t); return err }); err != nil {
		return a.fail(err)
	}
	if a.p.json() {
		return a.printJSON(resp)
	}
	s, l := resp.Session, resp.Lifecycle
	tw := tabwriter.NewWriter(a.sys.Stdout, 0, 0, 2, ' ', 0)
	if resp.Probe == "no_sandbox" && s.RunID == "" {
		fmt.Fprintf(tw, "probe\t%s (%s)\n", resp.Probe, resp.Detail)
		fmt.Fprintf(tw, "repository\t%s\nbranch\t%s\nconfig\t%s\n", s.RepoRoot, s.Branch, relConfig(s))
		tw.Flush()
		return ExitOK
	}
	probe := resp.Probe
	if resp.Detail != "" {
		probe += " (" + resp.Detail + ")"
	}
	fmt.Fprintf(tw, "run\t%s%s\n", s.RunID, spaced(s.RunURL))
	fmt.Fprintf(tw, "probe\t%s\n", probe)
	if resp.ExpiresAt != nil {
		line := resp.ExpiresAt.Local().Format(time.RFC3339)
		if p := s.ExpiryPulledAt; p != nil {
			line += ", its edits pulled ahead at " + p.Local().Format("15:04:05")
		}
		fmt.Fprintf(tw, "expires\t%s\n", line)
	}
	fmt.Fprintf(tw, "repository\t%s\nbranch\t%s\nconfig\t%s\n", s.RepoRoot, s.Branch, relConfig(s))
	state := l.State
	if l.Reason != "" {
		state += " (" + l.Reason + ")"
	}
	fmt.Fprintf(tw, "state\t%s, created %s\n", state, l.Created.Local().Format(time.RFC3339))
	fmt.Fprintf(tw, "execs\t%d, last %s\n", l.ExecCount, a.ago(l.LastExec))
	fmt.Fprintf(tw, "snapshot\t%v\n", resp.HasSnapshot)
	if resp.Isolation != "" {
		fmt.Fprintf(tw, "isolation\t%s\n", resp.Isolation)
	}
	tw.Flush()
	if s.ConfigDrift {
		a.warn(ipc.DriftWarning(s.ConfigFile))
	}
	return ExitOK
}

func (a *app) events(ctx context.Context) int {
	var since *uint64
	if s := a.p.strings["since"]; s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			return a.usage(&usageError{cmd: a.p.cmd, msg: fmt.Sprintf("--since %q is not a sequence number", s)})
		}
		since = &n
	}
	ctx, stop := a.interruptContext(ctx)
	defer stop()
	var st *client.EventStream
	if err := a.call(ctx, func(ctx context.Context) (err error) { st, err = a.c.Events(ctx, since); return err }); err != nil {
		return a.fail(err)
	}
	defer st.Close()
	for {
		ev, err := st.Next()
		if err != nil {
			if ctx.Err() != nil {
				return ExitOK // the user ended it
			}
			return a.fail(err)
		}
		if a.p.json() {
			a.printJSON(ev)
			continue
		}
		line := fmt.Sprintf("%s #%d %s", ev.Time.Local().Format("15:04:05.000"), ev.Seq, ev.Type)
		if ev.RunID != "" {
			line += " run=" + ev.RunID
		}
		if ev.SessionID != "" {
			line += " session=" + ev.SessionID
		}
		if len(ev.Data) > 0 && string(ev.Data) != "null" {
			line += " " + string(ev.Data)
		}
		fmt.Fprintln(a.sys.Stdout, line)
	}
}

// spaced is s after a space, or nothing when s is empty (a run of the
// local remote has no URL to show).
func spaced(s string) string {
	if s == "" {
		return ""
	}
	return " " + s
}

// endEdits says what became of an ended sandbox's edits: warnings on
// stderr; what was pulled, saved or discarded on stderr too, so that
// --json output stays one value.
func (a *app) endEdits(e ipc.EndEdits) {
	for _, w := range e.Warnings {
		a.warn(w)
	}
	if len(e.PulledFiles) > 0 {
		fmt.Fprintf(a.sys.Stderr, "Pulled from %s first: %s\n", e.RunID, strings.Join(e.PulledFiles, ", "))
	}
	if e.SavedPatch != "" {
		fmt.Fprintf(a.sys.Stderr, "Saved the edits of %s at %s (apply with `git apply --3way %s`)\n", e.RunID, e.SavedPatch, e.SavedPatch)
	}
	if len(e.Discarded) > 0 {
		fmt.Fprintf(a.sys.Stderr, "Discarded the edits %s held to: %s\n", e.RunID, strings.Join(e.Discarded, ", "))
	} else if e.Discarded != nil {
		fmt.Fprintf(a.sys.Stderr, "Discarded nothing: %s held no unpulled edits\n", e.RunID)
	}
}

// pull brings the sandbox's edits back into the checkout now.
func (a *app) pull(ctx context.Context) int {
	t, err := a.target()
	if err != nil {
		return a.fail(err)
	}
	var resp ipc.PullResponse
	if err := a.call(ctx, func(ctx context.Context) (err error) { resp, err = a.c.Pull(ctx, t); return err }); err != nil {
		return a.fail(err)
	}
	for _, w := range resp.Warnings {
		a.warn(w)
	}
	if a.p.json() {
		return a.printJSON(resp)
	}
	switch {
	case len(resp.Files) > 0:
		fmt.Fprintf(a.sys.Stdout, "Pulled %d file(s) from sandbox %s: %s\n", len(resp.Files), resp.RunID, strings.Join(resp.Files, ", "))
	case resp.SavedPatch == "":
		fmt.Fprintf(a.sys.Stdout, "Nothing to pull: sandbox %s holds no edits that did not come back\n", resp.RunID)
	}
	if resp.SavedPatch != "" {
		fmt.Fprintf(a.sys.Stdout, "Saved the edits that did not apply at %s (apply with `git apply --3way %s`)\n", resp.SavedPatch, resp.SavedPatch)
	}
	return ExitOK
}

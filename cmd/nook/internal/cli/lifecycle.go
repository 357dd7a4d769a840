package cli

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/sandboxd/sandboxd/ipc"
)

// prune ends and forgets the sessions whose checkout is gone or whose run
// ended.
func (a *app) prune(ctx context.Context) int {
	req := ipc.PruneRequest{DryRun: a.p.bools["dry-run"]}
	var resp ipc.PruneResponse
	if err := a.call(ctx, func(ctx context.Context) (err error) { resp, err = a.c.Prune(ctx, req); return err }); err != nil {
		return a.fail(err)
	}
	for _, w := range resp.Warnings {
		a.warn(w)
	}
	if a.p.json() {
		if resp.Pruned == nil {
			resp.Pruned = []ipc.PrunedSession{}
		}
		return a.printJSON(resp)
	}
	if len(resp.Pruned) == 0 {
		fmt.Fprintln(a.sys.Stdout, "Nothing to prune: every sandbox's checkout exists and its run is live.")
		return ExitOK
	}
	verb := "Pruned"
	if req.DryRun {
		verb = "Would prune"
	}
	for _, p := range resp.Pruned {
		run := p.Session.RunID
		if run == "" {
			run = p.Session.ID
		}
		line := fmt.Sprintf("%s %s (%s, %s): %s", verb, run, p.Session.RepoRoot, p.Session.Branch, p.Detail)
		if p.Stopped {
			if req.DryRun {
				line += "; its run would be ended"
			} else {
				line += "; its run was ended"
			}
		}
		fmt.Fprintln(a.sys.Stdout, line)
	}
	return ExitOK
}

// keep pins the sandbox of this checkout against the idle stop (--off
// unpins it).
func (a *app) keep(ctx context.Context) int {
	t, err := a.target()
	if err != nil {
		return a.fail(err)
	}
	req := ipc.KeepRequest{Target: t, Off: a.p.bools["off"]}
	var resp ipc.KeepResponse
	if err := a.call(ctx, func(ctx context.Context) (err error) { resp, err = a.c.Keep(ctx, req); return err }); err != nil {
		return a.fail(err)
	}
	if a.p.json() {
		return a.printJSON(resp)
	}
	if req.Off {
		msg := fmt.Sprintf("Sandbox %s is no longer kept", resp.Session.RunID)
		if resp.Session.IdleStopAt != nil {
			msg += "; the idle stop stops it " + a.until(resp.Session.IdleStopAt) + " unless it is used"
		}
		fmt.Fprintln(a.sys.Stdout, msg+".")
		return ExitOK
	}
	fmt.Fprintf(a.sys.Stdout, "Sandbox %s is kept: the idle stop leaves it (nook keep --off undoes this).\n", resp.Session.RunID)
	return ExitOK
}

// idleColumn is the IDLE column of nook list: how long a ready sandbox has
// been unused, "busy" while it works.
func idleColumn(s ipc.SessionInfo) string {
	switch {
	case s.Status != "ready":
		return "-"
	case s.IdleSeconds == nil:
		return "busy"
	}
	return shortDuration(time.Duration(*s.IdleSeconds) * time.Second)
}

// stopColumn is the IDLE STOP column: when the idle stop would stop it.
func (a *app) stopColumn(s ipc.SessionInfo) string {
	switch {
	case s.Kept:
		return "kept"
	case s.IdleStopAt == nil:
		return "-"
	}
	return a.until(s.IdleStopAt)
}

// expiresColumn is the EXPIRES column: when the remote ends the run, when
// it says, and whether the edits were pulled ahead of it.
func (a *app) expiresColumn(s ipc.SessionInfo) string {
	if s.ExpiresAt == nil {
		return "-"
	}
	if s.ExpiryPulledAt != nil {
		return a.until(s.ExpiresAt) + " (pulled)"
	}
	return a.until(s.ExpiresAt)
}

// until says how far ahead t is ("in 4m", "now").
func (a *app) until(t *time.Time) string {
	d := t.Sub(a.sys.Now())
	if d <= 0 {
		return "now"
	}
	return "in " + shortDuration(d)
}

func shortDuration(d time.Duration) string {
	switch {
	case d < time.Minute:
		return strconv.Itoa(int(d/time.Second)) + "s"
	case d < time.Hour:
		return strconv.Itoa(int(d/time.Minute)) + "m"
	}
	return strconv.Itoa(int(d/time.Hour)) + "h" + strconv.Itoa(int(d%time.Hour/time.Minute)) + "m"
}

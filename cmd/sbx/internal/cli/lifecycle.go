package cli

import (
	"context"
	"fmt"

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

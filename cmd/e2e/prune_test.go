package e2e

import (
	"os"
	"strings"
	"testing"
)

type pruneJSON struct {
	DryRun bool `json:"dryRun"`
	Pruned []struct {
		Session struct {
			ID    string `json:"id"`
			RunID string `json:"runId"`
		} `json:"session"`
		Why     string `json:"why"`
		Detail  string `json:"detail"`
		Stopped bool   `json:"stopped"`
	} `json:"pruned"`
}

// TestPruneEndsAndForgetsTheSandboxOfADeletedCheckout deletes a checkout
// whose sandbox runs: `nook prune --dry-run` names it and changes nothing,
// `nook prune` ends its run and forgets it, and the sandbox of a checkout
// that still exists is kept.
func TestPruneEndsAndForgetsTheSandboxOfADeletedCheckout(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	gone := e.newRepo("gone", defaultConfig)
	kept := e.newRepo("kept", defaultConfig)
	goneRun := e.startSandbox(gone)
	keptRun := e.startSandbox(kept)
	if err := os.RemoveAll(gone); err != nil {
		t.Fatal(err)
	}

	dry := decode[pruneJSON](t, e.mustNook(kept, "prune", "--dry-run", "--json").stdout)
	if !dry.DryRun || len(dry.Pruned) != 1 || dry.Pruned[0].Session.RunID != goneRun || dry.Pruned[0].Why != "checkout_gone" || !dry.Pruned[0].Stopped {
		t.Fatalf("dry run must name the deleted checkout's live sandbox %s only: %+v", goneRun, dry)
	}
	list := decode[listJSON](t, e.mustNook(kept, "list", "--json").stdout)
	if len(list.Sessions) != 2 {
		t.Fatalf("a dry run must change nothing: %+v", list)
	}

	text := e.mustNook(kept, "prune")
	if !strings.Contains(text.stdout, goneRun) || !strings.Contains(text.stdout, "is gone") || !strings.Contains(text.stdout, "run was ended") {
		t.Fatalf("prune must say what it pruned and why: %s", text)
	}
	all := decode[listJSON](t, e.mustNook(kept, "list", "--all", "--json").stdout)
	for _, s := range all.Sessions {
		if s.RunID == goneRun {
			t.Fatalf("the pruned session is still known: %+v", all)
		}
	}
	if len(all.Sessions) != 1 || all.Sessions[0].RunID != keptRun || all.Sessions[0].Status != "ready" {
		t.Fatalf("the sandbox of the existing checkout must be kept ready: %+v", all)
	}
	again := decode[pruneJSON](t, e.mustNook(kept, "prune", "--json").stdout)
	if len(again.Pruned) != 0 {
		t.Fatalf("a second prune has nothing to do: %+v", again)
	}
}

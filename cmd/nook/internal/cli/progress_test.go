package cli

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/ipc"
)

func phases() []ipc.Progress {
	return []ipc.Progress{
		{Phase: ipc.PhaseDaemonStarting},
		{Phase: ipc.PhaseCreating},
		{Phase: ipc.PhaseCreated, RunURL: "https://x/runs/1"},
		{Phase: ipc.PhaseProvisioning, Message: "setup step deps (1/2)"},
		{Phase: ipc.PhaseProvisioning, Message: "setup step deps (1/2)"}, // repeated: shown once
		{Phase: ipc.PhaseConnecting},
	}
}

// Not a terminal: one timestamped line per phase; a terminal: one line
// rewritten in place, the run URL on a line of its own, cleared at the end;
// --quiet: nothing.
func TestProgressRendering(t *testing.T) {
	now := func() time.Time { return time.Date(2026, 1, 2, 3, 4, 5, 0, time.Local) }
	var plain bytes.Buffer
	p := &progress{w: &plain, now: now}
	for _, ph := range phases() {
		p.show(ph)
	}
	p.done()
	want := "nook: 03:04:05 starting sandboxd\nnook: 03:04:05 creating the sandbox run\nnook: 03:04:05 run created: https://x/runs/1\n" +
		"nook: 03:04:05 provisioning: setup step deps (1/2)\nnook: 03:04:05 connecting to the sandbox\n"
	if plain.String() != want {
		t.Errorf("plain progress:\n%q\nwant\n%q", plain.String(), want)
	}

	var tty bytes.Buffer
	p = &progress{w: &tty, tty: true, now: now}
	for _, ph := range phases() {
		p.show(ph)
	}
	p.done()
	out := tty.String()
	if strings.Count(out, "\n") != 1 || !strings.Contains(out, "\r\x1b[Knook: run created: https://x/runs/1\n") ||
		!strings.Contains(out, "\r\x1b[K⠋ provisioning: setup step deps (1/2)") || !strings.HasSuffix(out, "\r\x1b[K") {
		t.Errorf("terminal progress %q", out)
	}

	var quiet bytes.Buffer
	p = &progress{w: &quiet, tty: true, quiet: true, now: now}
	for _, ph := range phases() {
		p.show(ph)
	}
	p.done()
	if quiet.Len() != 0 {
		t.Errorf("--quiet printed %q", quiet.String())
	}
}

package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestReattachToAHelperThatGoesSilentEndsAtItsBoundAndSaysSo: a held
// command replaces the sandbox helper with one that never answers, then
// its connection drops; the daemon reattaches on a new connection and asks
// the helper about the command. That question says on stderr what it waits
// for past a second, and ends at its bound (the probe timeout plus a
// process's start) with exit 125 and a report, instead of waiting for ever.
func TestReattachToAHelperThatGoesSilentEndsAtItsBoundAndSaysSo(t *testing.T) {
	t.Parallel()
	b := currentSilence()
	e := newEnv(t)
	lc := e.startSilentLocalcloud(b)
	e.writeConfig(map[string]any{"ssh_probe_timeout": b.probeTimeout.String(), "durable_exec": true})
	d := e.startDaemon()
	repo := e.newRepo("silenthelper", defaultConfig)
	run := e.startSandbox(repo)
	e.mustSbx(repo, "exec", "--", "true")
	e.waitHelper(t, run)
	e.mustSbx(repo, "exec", "--", "true")
	counter := counterFile(t, "silenthelper")
	// The running holder keeps its inode; every later start of the helper
	// (the daemon's question) gets the silent one.
	script := fmt.Sprintf(`for f in .git/sandboxd/bin/sandboxd-helper-*; do printf '#!/bin/sh\nexec sleep 120\n' > "$f.new" && chmod 755 "$f.new" && mv -f "$f.new" "$f"; done
echo ran >> %s; sleep 60`, counter)
	cmd := e.sbxBackground(repo, "exec", "--no-sync", "--", "sh", "-c", script)
	waitUntil(t, 30*time.Second, "the command to start", func() bool { return strings.Contains(readFileOr(counter), "ran") })
	lc.call(t, "POST", "/admin/silence", map[string]any{"duration_ms": b.silence.Milliseconds(), "drop": true})
	start := time.Now()
	r := cmd.wait(t, 45*time.Second)
	took := time.Since(start)
	if r.code != 125 || !strings.Contains(r.stderr, "the sandbox helper did not answer about the held command within") {
		d.stop(t)
		t.Fatalf("a reattach whose helper never answers: %s\n%s", r, d.logs)
	}
	if !strings.Contains(r.stderr, "waiting for the sandbox helper to answer about the held command since") {
		t.Errorf("no word of the wait for the helper on stderr:\n%s", r.stderr)
	}
	if n := strings.Count(readFileOr(counter), "ran"); n != 1 {
		t.Errorf("the command ran %d times", n)
	}
	t.Logf("a reattach to a silent helper ended %v after the silence began\n%s", took.Round(time.Millisecond), r.stderr)
}

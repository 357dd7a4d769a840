package localcloud

import (
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/localcloud/runs"
)

// TestSilenceHoldsOpenAgentConnectionsAndAnswersItsCaller: POST
// /admin/silence holds the bytes of the agent connections open at the
// time (an exec on one waits out the silence), while the caller gets its
// answer at once and a new SSH connection works during the silence.
func TestSilenceHoldsOpenAgentConnectionsAndAnswersItsCaller(t *testing.T) {
	isolate(t)
	const silence = 1500 * time.Millisecond
	srv := startServer(t, Config{})
	c := newClient(t, srv)
	id := c.create(repo(t, "tasks:\n  - key: sandbox\n    run: rwx-sandbox\n"), "")
	c.waitState(id, runs.Sandboxable)
	ci := c.connInfo(id)
	old := dialSandbox(t, ci)
	output(t, old, "true")

	start := time.Now()
	var ans SilenceAnswer
	c.call(200, "POST", "/admin/silence", SilenceRequest{DurationMS: silence.Milliseconds()}, &ans)
	if took := time.Since(start); took > silence/2 {
		t.Fatalf("the silence's own request was answered after %v", took)
	}
	if ans.Direction != "both" || ans.Until.Sub(ans.From) != silence {
		t.Fatalf("answer %+v", ans)
	}
	c.status(id) // the caller's connection is spared

	fresh := dialSandbox(t, ci)
	if out, code := output(t, fresh, "echo fresh"); code != 0 || out != "fresh\n" {
		t.Fatalf("a new connection during the silence: %d %q", code, out)
	}
	if took := time.Since(start); took > silence*2/3 {
		t.Fatalf("a new connection during the silence worked only after %v", took)
	}
	if out, code := output(t, old, "echo old"); code != 0 || out != "old\n" {
		t.Fatalf("an open connection after the silence: %d %q", code, out)
	}
	if took := time.Since(start); took < silence {
		t.Fatalf("an exec on a connection open before the silence of %v came back after %v", silence, took)
	}
}

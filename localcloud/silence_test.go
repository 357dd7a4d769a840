package localcloud

import (
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/localcloud/agent"
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

// TestAgentFreesTheLockOfAClientThatWentSilent: a client holds the sandbox
// lock when the network changes under it (its connection silent for good,
// never closed); a new connection gets the lock once the agent's
// keepalives (interval x count, as configured) found the old one dead.
func TestAgentFreesTheLockOfAClientThatWentSilent(t *testing.T) {
	isolate(t)
	const interval, count = 250 * time.Millisecond, 2
	srv := startServer(t, Config{AgentKeepaliveInterval: interval, AgentKeepaliveCount: count})
	c := newClient(t, srv)
	id := c.create(repo(t, "tasks:\n  - key: sandbox\n    run: rwx-sandbox\n"), "")
	c.waitState(id, runs.Sandboxable)
	ci := c.connInfo(id)
	holder := dialSandbox(t, ci)
	if _, code := output(t, holder, agent.DirectiveLockRequested); code != 0 {
		t.Fatalf("lock request: exit %d", code)
	}
	c.call(200, "POST", "/admin/silence", SilenceRequest{DurationMS: 60_000, Drop: true}, nil)
	start := time.Now()
	next := dialSandbox(t, ci)
	granted := make(chan int, 1)
	go func() {
		s, err := next.NewSession()
		if err != nil {
			granted <- -1
			return
		}
		defer s.Close()
		if s.Run(agent.DirectiveLockRequested) != nil {
			granted <- -1
			return
		}
		granted <- 0
	}()
	select {
	case code := <-granted:
		if code != 0 {
			t.Fatal("the lock request on the new connection failed")
		}
	case <-time.After(interval*count + 3*time.Second):
		t.Fatalf("the lock of a client silent for %v is still held (keepalive %v x %d)", time.Since(start), interval, count)
	}
	took := time.Since(start)
	if took > interval*(count+1)+time.Second {
		t.Fatalf("the lock went to the new connection after %v, want within %v x %d + margin", took, interval, count)
	}
	t.Logf("the new connection got the lock %v after the silence began", took)
}

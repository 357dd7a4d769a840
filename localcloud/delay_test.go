package localcloud

import (
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/localcloud/agent"
	"github.com/sandboxd/sandboxd/localcloud/runs"
)

// With a one-way delay, both the API and the agent answer one round trip
// later (2*delay), and the agent counts channel opens and exec requests per
// connection for the benchmark.
func TestOneWayDelayAndSSHStats(t *testing.T) {
	isolate(t)
	const delay = 10 * time.Millisecond
	srv := startServer(t, Config{OneWayDelay: delay})
	c := newClient(t, srv)
	id := c.create(repo(t, "tasks:\n  - key: sandbox\n    run: rwx-sandbox\n"), "")
	c.waitState(id, runs.Sandboxable)

	start := time.Now()
	c.status(id) // a kept-alive HTTPS connection: one round trip
	if took := time.Since(start); took < 2*delay {
		t.Fatalf("an API call took %s, less than the injected round trip %s", took, 2*delay)
	}

	sc := dialSandbox(t, c.connInfo(id))
	var before agent.Stats
	c.call(200, "GET", "/admin/runs/"+id+"/ssh-stats", nil, &before)
	start = time.Now()
	if out, code := output(t, sc, "true"); code != 0 || out != "" {
		t.Fatalf("true: %d %q", code, out)
	}
	if took := time.Since(start); took < 2*delay {
		t.Fatalf("an exec took %s, less than the injected round trip %s", took, 2*delay)
	}
	output(t, sc, "true")
	var after agent.Stats
	c.call(200, "GET", "/admin/runs/"+id+"/ssh-stats", nil, &after)
	if d := after.ExecRequests - before.ExecRequests; d != 2 {
		t.Fatalf("exec requests grew by %d over two execs, want 2 (%+v → %+v)", d, before, after)
	}
	if d := after.ChannelOpens - before.ChannelOpens; d != 2 {
		t.Fatalf("channel opens grew by %d over two execs, want 2", d)
	}
	// The delay can change while the connection lives.
	c.call(200, "POST", "/admin/faults", map[string]int64{"one_way_delay_ms": 25}, nil)
	start = time.Now()
	output(t, sc, "true")
	if took := time.Since(start); took < 50*time.Millisecond {
		t.Fatalf("after raising the delay to 25ms an exec took %s", took)
	}
	c.call(200, "GET", "/admin/runs/"+id+"/ssh-stats", nil, &after)
	if after.Connections != 1 || len(after.PerConn) != 1 || after.PerConn[0].ExecRequests != after.ExecRequests || !after.PerConn[0].Open {
		t.Fatalf("per-connection stats %+v", after)
	}
}

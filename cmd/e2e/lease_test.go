package e2e

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
)

// While this daemon runs a burst of execs on a sandbox (each one starting
// before the lock's idle time could pass), another client doing lock →
// command → unlock by hand on its own SSH connection is served during the
// burst: the daemon's lease on the agent lock yields at an exec boundary
// once held for its idle time, and the agent grants the lock in request
// order. Before the lease yielded, the other client waited for the whole
// burst.
func TestLeaseServesAnotherClientDuringABurst(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	e.startDaemon()
	repo := e.newRepo("lease", defaultConfig)
	run := e.startSandbox(repo)
	e.mustNook(repo, "exec", "--no-sync", "--", "true")

	other := lc.sshTo(t, run)
	run1 := func(cmd string) {
		s, err := other.NewSession()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if err := s.Run(cmd); err != nil {
			t.Fatalf("%s: %v", cmd, err)
		}
	}

	// The burst: back-to-back execs from the client library (no process
	// start between them, so the lease never idles out) until the other
	// client is done, or a cap far beyond the lease's idle time.
	const maxBurst = 600
	var served atomic.Bool
	var execs atomic.Int64
	burstDone := make(chan struct{})
	c := client.New(e.socket())
	defer c.Close()
	go func() {
		defer close(burstDone)
		for i := 0; i < maxBurst && !served.Load(); i++ {
			res, err := c.Exec(context.Background(), ipc.ExecRequest{Target: ipc.Target{Cwd: repo}, Argv: []string{"true"}, NoSync: true}, client.ExecOptions{})
			if err != nil || res.ExitCode != 0 {
				t.Errorf("burst exec %d: %v %+v", i, err, res)
				return
			}
			execs.Add(1)
		}
	}()
	waitUntil(t, time.Minute, "the burst to be under way", func() bool { return execs.Load() >= 3 })
	run1("__rwx_sandbox_lock_requested__")
	run1("true")
	run1("__rwx_sandbox_lock_released__")
	served.Store(true)
	at := execs.Load()
	<-burstDone
	if at >= maxBurst {
		t.Fatalf("the other client was served only after the daemon's burst of %d execs ended", maxBurst)
	}
	t.Logf("served after %d execs of the burst", at)
}

package e2e

import (
	"sync/atomic"
	"testing"
	"time"
)

// Issue 29: the lease keeps the agent lock through a burst longer than its
// idle time (so that the yield's round trips land on few execs), and still
// serves another client within a bound. While nook execs run in a loop
// (each process starting before the lock could idle out), a raw lock
// request on its own SSH connection, as the RWX CLI sends it, is granted
// within the burst's longest hold (8 × 250 ms) plus the exec that runs and
// slack for a loaded machine, far sooner than the loop's end.
func TestLeaseGrantsAWaitingClientWithinTheBurstHold(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	e.startDaemon()
	repo := e.newRepo("leasefair", defaultConfig)
	run := e.startSandbox(repo)
	e.mustNook(repo, "exec", "--no-sync", "--", "true")

	const (
		bound   = 6 * time.Second  // 2 s hold + an exec + slack under -race
		loopCap = 40 * time.Second // the burst's own end, far beyond bound
	)
	var stop atomic.Bool
	var execs atomic.Int64
	loopDone := make(chan struct{})
	go func() {
		defer close(loopDone)
		end := time.Now().Add(loopCap)
		for !stop.Load() && time.Now().Before(end) {
			if out, err := e.nookCmd(repo, "exec", "--no-sync", "--", "true").CombinedOutput(); err != nil {
				t.Errorf("burst exec: %v: %s", err, out)
				return
			}
			execs.Add(1)
		}
	}()
	defer func() { stop.Store(true); <-loopDone }()
	waitUntil(t, time.Minute, "the nook loop to be under way", func() bool { return execs.Load() >= 3 })

	other := lc.sshTo(t, run)
	s, err := other.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	at := execs.Load()
	start := time.Now()
	granted := make(chan error, 1)
	go func() { granted <- s.Run("__rwx_sandbox_lock_requested__") }()
	select {
	case err := <-granted:
		if err != nil {
			t.Fatalf("the other client's lock request: %v", err)
		}
	case <-time.After(loopCap + 10*time.Second):
		t.Fatalf("the other client's lock request was not answered within %s", loopCap+10*time.Second)
	}
	waited := time.Since(start)
	if waited > bound {
		t.Fatalf("the other client waited %s for the lock while nook execs ran in a loop, want at most %s", waited.Round(time.Millisecond), bound)
	}
	// Holding it, the other client keeps the loop's execs waiting.
	held := execs.Load()
	time.Sleep(500 * time.Millisecond)
	if n := execs.Load(); n > held+1 {
		t.Fatalf("%d nook execs ran while the other client held the lock", n-held)
	}
	s2, err := other.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if err := s2.Run("__rwx_sandbox_lock_released__"); err != nil {
		t.Fatalf("release the other client's lock: %v", err)
	}
	t.Logf("granted after %s and %d execs of the loop", waited.Round(time.Millisecond), execs.Load()-at)
}

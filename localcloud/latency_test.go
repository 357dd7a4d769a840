//go:build linux

package localcloud

import (
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/localcloud/runs"
)

// measureEnv, set to a count, makes TestIdleGapExecLatency run that many
// execs per gap; the test is a measurement, skipped otherwise (it says
// nothing under -race or a loaded machine).
const measureEnv = "LOCALCLOUD_MEASURE_EXECS"

// TestIdleGapExecLatency times `true` through a kept SSH connection to an
// isolated sandbox, each exec after an idle gap: moving a process into a
// cgroup waits for an RCU grace period, which an idle machine makes long,
// so the gap matters as much as the exec.
func TestIdleGapExecLatency(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv(measureEnv))
	if n <= 0 {
		t.Skip("a measurement: set " + measureEnv + "=N to run it")
	}
	isolate(t)
	srv := startServer(t, Config{})
	c := newClient(t, srv)
	id := c.create(repo(t, plainConfig), "")
	c.waitState(id, runs.Sandboxable)
	sc := dialSandbox(t, c.connInfo(id))
	for range 5 { // warm up: the first commands start what later ones reuse
		if _, code := output(t, sc, "true"); code != 0 {
			t.Fatalf("true exited %d", code)
		}
	}
	for _, gap := range []time.Duration{0, 10 * time.Millisecond, 30 * time.Millisecond} {
		var took []time.Duration
		for range n {
			time.Sleep(gap)
			start := time.Now()
			if _, code := output(t, sc, "true"); code != 0 {
				t.Fatalf("true exited %d", code)
			}
			took = append(took, time.Since(start))
		}
		slices.Sort(took)
		t.Logf("gap %5s: median %6.2f ms, p90 %6.2f ms, max %6.2f ms (n=%d)", gap,
			ms(took[len(took)/2]), ms(took[len(took)*9/10]), ms(took[len(took)-1]), n)
	}
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

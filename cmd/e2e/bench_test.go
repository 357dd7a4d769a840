package e2e

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

// What these time beyond `make bench` (cmd/sandboxd-bench, which has the
// exec scenarios): ns/op is the mean, ms-median the median.
//
//	make bench-go BENCH_PKGS=./cmd/e2e/ BENCHTIME=20x

func reportMedian(b *testing.B, samples []time.Duration) {
	b.Helper()
	if len(samples) == 0 {
		return
	}
	slices.Sort(samples)
	b.ReportMetric(float64(samples[len(samples)/2].Microseconds())/1000, "ms-median")
}

func timeNook(b *testing.B, e *env, dir string, args ...string) {
	b.Helper()
	var samples []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		if r := e.nook(dir, args...); r.code != 0 {
			b.Fatalf("nook %v: %s", args, r)
		}
		samples = append(samples, time.Since(start))
	}
	b.StopTimer()
	reportMedian(b, samples)
}

// BenchmarkNookVersion: `nook version` answered by a running daemon.
func BenchmarkNookVersion(b *testing.B) {
	e := newEnv(b)
	e.startDaemon()
	timeNook(b, e, e.root, "version")
}

// BenchmarkReconnect20AfterRestart: time from a restart (after SIGKILL) of
// the daemon with 20 live sandboxes until all 20 are reconnected, as seen
// in its events; no client asks meanwhile.
func BenchmarkReconnect20AfterRestart(b *testing.B) {
	e := newEnv(b)
	d := e.startDaemon()
	runs := map[string]bool{}
	for i := range 20 {
		runs[e.startSandbox(e.newRepo(fmt.Sprintf("r%d", i), defaultConfig))] = true
	}
	var samples []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		d.kill()
		b.StartTimer()
		start := time.Now()
		d = e.startDaemon()
		evs := e.followEvents("0")
		up := map[string]bool{}
		for len(up) < len(runs) {
			ev := evs.waitFor(e.t, time.Minute, "connection.up", eventType("connection.up"))
			if id, _ := ev["runId"].(string); runs[id] {
				up[id] = true
			}
		}
		samples = append(samples, time.Since(start))
		evs.stop()
	}
	b.StopTimer()
	reportMedian(b, samples)
}

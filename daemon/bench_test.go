package daemon

import (
	"slices"
	"syscall"
	"testing"
	"time"
)

// BenchmarkStartToReady measures the daemon's start-to-ready time: from
// exec of the sandboxd binary to READY=1 on a notify socket (store opened,
// socket listening, serving). Every iteration starts a fresh process on the
// same (non-empty after the first run) state directory, as a restart does.
// ns/op is the mean; ms-median/ready the median.
//
//	go test -run '^$' -bench StartToReady -benchtime 20x ./daemon/
func BenchmarkStartToReady(b *testing.B) {
	e := newTestEnv(b)
	n := newNotifySocket(b, e.root)
	env := e.environ(n.env())
	var samples []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		p := startProc(b, env, sandboxdBin)
		n.waitFor(b, "READY=1", readyTimeout, p)
		samples = append(samples, time.Since(start))
		b.StopTimer()
		p.signal(b, syscall.SIGTERM)
		n.waitFor(b, "STOPPING=1", exitTimeout, p)
		if code := p.wait(b, exitTimeout); code != 0 {
			b.Fatalf("exit %d", code)
		}
		b.StartTimer()
	}
	slices.Sort(samples)
	b.ReportMetric(float64(samples[len(samples)/2].Microseconds())/1000, "ms-median/ready")
}

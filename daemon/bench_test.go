package daemon

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/store"
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

// BenchmarkStartToReady1000Sessions is BenchmarkStartToReady with 1,000
// live sessions in the store: READY=1 comes once the store is loaded, not
// after the network (each session is re-checked in the background). The
// store is restored before every start, since the re-checks change it.
//
//	go test -run '^$' -bench StartToReady1000 -benchtime 20x ./daemon/
func BenchmarkStartToReady1000Sessions(b *testing.B) {
	e := newTestEnv(b)
	db := filepath.Join(e.vars["XDG_STATE_HOME"], "sandboxd", "sandboxd.db")
	st, err := store.Open(context.Background(), db, store.Options{})
	if err != nil {
		b.Fatal(err)
	}
	for i := range 1000 {
		s := &store.Session{
			Identity:       store.Identity{RepoRoot: fmt.Sprintf("/src/repo%d", i), Branch: "main", ConfigFile: fmt.Sprintf("/src/repo%d/.rwx/sandbox.yml", i)},
			Remote:         "local",
			RunID:          fmt.Sprintf("run-%04d", i),
			IdempotencyKey: fmt.Sprintf("key-%04d", i),
			Address:        "127.0.0.1:1",
			State:          store.StateReady,
		}
		if err := st.Insert(s); err != nil {
			b.Fatal(err)
		}
	}
	st.Close()
	golden, err := os.ReadFile(db)
	if err != nil {
		b.Fatal(err)
	}
	n := newNotifySocket(b, e.root)
	env := e.environ(n.env())
	var samples []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		if err := os.WriteFile(db, golden, 0o600); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		start := time.Now()
		p := startProc(b, env, sandboxdBin)
		n.waitFor(b, "READY=1", readyTimeout, p)
		samples = append(samples, time.Since(start))
		b.StopTimer()
		p.signal(b, syscall.SIGTERM)
		n.waitFor(b, "STOPPING=1", exitTimeout, p)
		p.wait(b, exitTimeout)
		b.StartTimer()
	}
	slices.Sort(samples)
	b.ReportMetric(float64(samples[len(samples)/2].Microseconds())/1000, "ms-median/ready")
}

package sessions

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/ipc"
)

// Exec records are gathered and written together, yet nothing that shows
// them sees them stale: a flush right after a burst finds every exec
// counted and the latest time, however the burst fell into writes.
func TestExecRecordsAreExactAfterABurst(t *testing.T) {
	m, st := newTestManager(t, newFakeRemoteAPI(t), time.Second)
	a := insertSession(t, st, "run-a", "ready")
	b := insertSession(t, st, "run-b", "ready")
	base := time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)
	var clock sync.Mutex
	tick := 0
	m.now = func() time.Time {
		clock.Lock()
		defer clock.Unlock()
		tick++
		return base.Add(time.Duration(tick) * time.Millisecond)
	}
	var wg sync.WaitGroup
	for i := range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := a
			if i%4 == 0 {
				s = b
			}
			m.recordExec(s, ipc.ExecResult{})
		}()
		if i%50 == 0 {
			time.Sleep(recordDelay + 10*time.Millisecond) // across writes
		}
	}
	wg.Wait()
	m.flushExecRecords()
	ga, _ := st.Get(a.ID)
	gb, _ := st.Get(b.ID)
	if ga.ExecCount != 150 || gb.ExecCount != 50 {
		t.Fatalf("exec counts %d and %d, want 150 and 50", ga.ExecCount, gb.ExecCount)
	}
	last := base.Add(200 * time.Millisecond)
	if !ga.LastExecAt.Before(last.Add(time.Millisecond)) || (!ga.LastExecAt.Equal(last) && !gb.LastExecAt.Equal(last)) {
		t.Fatalf("last exec times %v and %v, the latest is %v", ga.LastExecAt, gb.LastExecAt, last)
	}
	// One exec, then straight to a reader: no waiting for the gathering.
	start := time.Now()
	m.recordExec(a, ipc.ExecResult{})
	m.flushExecRecords()
	if ga, _ := st.Get(a.ID); ga.ExecCount != 151 {
		t.Fatalf("exec count %d right after a flush, want 151", ga.ExecCount)
	}
	if took := time.Since(start); took >= recordDelay {
		t.Logf("the flush took %v (the machine is slow, or it waited for the gathering)", took)
	}
}

// Two execs of one session ending together: the later end stays the last
// exec time, whichever of them is recorded first (each takes its time
// before the records' lock, so the later one may get there first).
func TestExecRecordKeepsTheLatestTime(t *testing.T) {
	m, st := newTestManager(t, newFakeRemoteAPI(t), time.Second)
	a := insertSession(t, st, "run-a", "ready")
	base := time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)
	var tick atomic.Int64
	called := make(chan struct{}, 2)
	// Time runs backwards: the first exec to take its time (and the first
	// to wait for the lock) has the later end.
	m.now = func() time.Time {
		defer func() { called <- struct{}{} }()
		return base.Add(-time.Duration(tick.Add(1)) * time.Millisecond)
	}
	m.records.Lock()
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m.recordExec(a, ipc.ExecResult{})
		}()
		<-called
		time.Sleep(time.Millisecond) // it waits for the lock before the next one does
	}
	m.records.Unlock()
	wg.Wait()
	m.flushExecRecords()
	latest := base.Add(-time.Millisecond)
	if got, _ := st.Get(a.ID); !got.LastExecAt.Equal(latest) {
		t.Fatalf("last exec time %v, want the later end %v", got.LastExecAt, latest)
	}
}

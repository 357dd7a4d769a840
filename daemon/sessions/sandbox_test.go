package sessions

import (
	"context"
	"fmt"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/daemon/events"
	"github.com/sandboxd/sandboxd/daemon/runsapi"
	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/ipc"
)

// stateEvents records the sandbox.state events a manager publishes.
type stateEvents struct {
	mu  sync.Mutex
	got []string // "from>to"
}

func (e *stateEvents) Publish(typ, sessionID, runID string, data any) ipc.Event {
	if typ != events.SandboxState {
		return ipc.Event{}
	}
	d := data.(map[string]string)
	e.mu.Lock()
	defer e.mu.Unlock()
	e.got = append(e.got, d["from"]+">"+d["state"])
	return ipc.Event{}
}

func (e *stateEvents) list() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return strings.Join(e.got, " ")
}

// Issue 27: a sandbox's controller goes through explicit states, changed
// in one place that publishes each change in order; the time of a change
// is the manager's clock; once ended it stays ended.
func TestSandboxStatesChangeInOnePlaceAndArePublished(t *testing.T) {
	_, target := startAgent(t)
	m, s, clock := leaseManager(t, target)
	ev := &stateEvents{}
	m.opts.Events = ev
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	c := m.sandboxOf(s)
	if st, _ := c.current(); st != stateConnecting {
		t.Fatalf("a new controller is %s, want connecting", st)
	}
	// The link's connection comes up: it says so from the pool's goroutine.
	if _, err := c.link.Get(ctx, target); err != nil {
		t.Fatal(err)
	}
	waitUntilTrue(t, "the link's up to be heard", func() bool { st, _ := c.current(); return st == stateReady })
	clock.add(time.Minute)
	_, done, err := m.lockSandbox(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	if st, since := c.current(); st != stateLeased || !since.Equal(clock.now()) {
		t.Fatalf("after the lock: %s since %v, want leased since %v (events %s)", st, since, clock.now(), ev.list())
	}
	done()
	// What the link tells its controller when the connection drops and
	// comes back.
	c.connectionChanged(false, fmt.Errorf("reset by peer"))
	c.connectionChanged(true, nil)
	m.releaseNow(c) // the lock went with the connection; nothing to send
	m.dropRuntime(s.ID)
	c.setState(stateReady, "too late")
	want := "connecting>ready ready>leased leased>reconnecting reconnecting>ready ready>ended"
	if got := ev.list(); got != want {
		t.Fatalf("state events\n got %s\nwant %s", got, want)
	}
}

// Issue 27: ending a controller joins every goroutine it started, even
// the lock request of a yield that waits behind another client: nothing
// of the controller runs once end returns.
func TestSandboxEndLeavesNoGoroutineBehind(t *testing.T) {
	_, target := startAgent(t)
	m, s, clock := leaseManager(t, target)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := m.sandboxOf(s)
	_, done, err := m.lockSandbox(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	// Another client asks for the lock while the lease holds it, and keeps
	// it once granted: the lease's own request after the yield waits.
	other := sshpool.New(sshpool.Options{})
	defer other.Close()
	oc, err := other.NewLink(nil).Get(ctx, target)
	if err != nil {
		t.Fatal(err)
	}
	granted := make(chan error, 1)
	go func() {
		_, err := oc.ExecOnce(ctx, directiveLock, sshpool.Stdio{})
		granted <- err
	}()
	time.Sleep(100 * time.Millisecond) // the other request is queued first
	clock.add(9 * time.Hour)
	done()
	if err := <-granted; err != nil {
		t.Fatal(err)
	}
	waitUntilTrue(t, "the lease to ask for the lock again", func() bool {
		c.lease.mu.Lock()
		defer c.lease.mu.Unlock()
		return c.lease.acquiring != nil
	})
	m.mu.Lock()
	delete(m.sandboxes, s.ID)
	m.mu.Unlock()
	c.end("test")
	if left := controllerGoroutines(); left != "" {
		t.Fatalf("goroutines of the controller still run after end:\n%s", left)
	}
}

// controllerGoroutines returns the stacks of the goroutines, other than the
// caller's, that run or were started by this package's non-test code.
func controllerGoroutines() string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var left []string
	for i, g := range strings.Split(string(buf), "\n\n") {
		if i == 0 { // the caller's
			continue
		}
		for _, line := range strings.Split(g, "\n") {
			if strings.Contains(line, "sandboxd/daemon/sessions.(*sandbox)") || strings.Contains(line, "sandboxd/daemon/sessions.(*Manager)") {
				left = append(left, g)
				break
			}
		}
	}
	return strings.Join(left, "\n\n")
}

// A controller whose session never runs a command (a listed or touched
// session, one that ended) costs no goroutine: its loop starts with the
// lease's first task.
func TestSandboxOfAnIdleSessionRunsNoGoroutine(t *testing.T) {
	_, target := startAgent(t)
	m, _, _ := leaseManager(t, target)
	for i := range 50 {
		m.touch(fmt.Sprintf("session-%d", i))
	}
	if left := controllerGoroutines(); left != "" {
		t.Fatalf("idle controllers run goroutines:\n%s", left)
	}
}

// A yield's reconnect that finds the run over ends the session from the
// controller's own loop: ending it must not wait for that loop (it would
// wait for itself), and the controller still ends and joins its loop.
func TestSandboxEndedFromItsOwnYieldEndsWithoutDeadlock(t *testing.T) {
	a, target := startAgent(t)
	m, s, clock := leaseManager(t, target)
	api := newFakeRemoteAPI(t)
	api.connStatus.Store(http.StatusNotFound) // the run is over
	client, err := runsapi.New(runsapi.Options{BaseURL: api.srv.URL, Token: "tok", Timeout: 5 * time.Second, MaxRetries: -1})
	if err != nil {
		t.Fatal(err)
	}
	m.opts.Remotes = fakeSource{client}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := m.sandboxOf(s)
	_, done, err := m.lockSandbox(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	a.Close() // the sandbox is gone with its run
	clock.add(9 * time.Hour)
	done() // the yield: the unlock fails, the reconnect asks the remote
	waitUntilTrue(t, "the controller to end", func() bool {
		st, _ := c.current()
		return st == stateEnded
	})
	joined := make(chan struct{})
	go func() { c.wg.Wait(); close(joined) }()
	select {
	case <-joined:
	case <-time.After(15 * time.Second):
		t.Fatal("the controller's loop did not end: ending the session from it waits for itself")
	}
}

// The link's up is heard from the pool's goroutine, possibly after the
// lock request that the new connection carried was granted: a leased
// controller stays leased; a down always means reconnecting.
func TestSandboxUpHeardAfterTheGrantLeavesItLeased(t *testing.T) {
	_, target := startAgent(t)
	m, s, _ := leaseManager(t, target)
	c := m.sandboxOf(s)
	c.setState(stateLeased, "granted")
	c.connectionChanged(true, nil)
	if st, _ := c.current(); st != stateLeased {
		t.Fatalf("an up heard after the grant moved the controller to %s, want leased", st)
	}
	c.connectionChanged(false, nil)
	c.connectionChanged(true, nil)
	if st, _ := c.current(); st != stateReady {
		t.Fatalf("after a down and an up: %s, want ready", st)
	}
}

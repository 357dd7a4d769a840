package agent

import (
	"net"
	"sync"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/localcloud/delayline"
)

// silence is a network silence a test starts on the agent's connections.
type silence struct {
	mu sync.Mutex
	s  delayline.Silence
}

func (x *silence) get() delayline.Silence {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.s
}

func (x *silence) start(d time.Duration, drop bool) {
	x.mu.Lock()
	defer x.mu.Unlock()
	now := time.Now()
	x.s = delayline.Silence{From: now, Until: now.Add(d), Drop: drop}
}

// TestLockOfASilentClientIsReleasedAfterKeepalives: a client that holds the
// sandbox lock and goes silent (its bytes lost, its connection never
// closed, as after a laptop's change of network) loses the lock once it
// answered no keepalive for interval x count; the next client gets it
// then, not when TCP gives up hours later.
func TestLockOfASilentClientIsReleasedAfterKeepalives(t *testing.T) {
	const interval, count = 200 * time.Millisecond, 3
	sl := &silence{}
	f := startWith(t, func(c *Config) {
		c.KeepaliveInterval, c.KeepaliveCount = interval, count
		c.WrapListener = func(ln net.Listener) net.Listener {
			return delayline.ListenerWith(ln, delayline.Options{Silence: sl.get})
		}
	})
	holder := f.dial(t)
	run(t, holder, DirectiveLockRequested, "")
	// The holder keeps answering keepalives while the network works.
	time.Sleep(2 * interval * count)
	sl.start(time.Minute, true)
	start := time.Now()
	// The client's new connection, as after a reconnect.
	next := f.dial(t)
	order := make(chan string, 1)
	requestLock(t, next, "next", order)
	select {
	case <-order:
	case <-time.After(interval*count + 2*time.Second):
		t.Fatalf("the lock of a client silent for %v is still held (keepalive %v x %d)", time.Since(start), interval, count)
	}
	if took := time.Since(start); took > interval*(count+1)+500*time.Millisecond {
		t.Fatalf("the lock of a silent client was released after %v, want within %v x %d + margin", took, interval, count)
	} else {
		t.Logf("lock released %v after the silence began (keepalive %v x %d)", took, interval, count)
	}
}

// TestKeepaliveSparesAClientThatAnswers: a live client idle for many
// intervals keeps its connection and its lock.
func TestKeepaliveSparesAClientThatAnswers(t *testing.T) {
	const interval, count = 100 * time.Millisecond, 2
	f := startWith(t, func(c *Config) { c.KeepaliveInterval, c.KeepaliveCount = interval, count })
	c := f.dial(t)
	run(t, c, DirectiveLockRequested, "")
	time.Sleep(10 * interval * count)
	if out, _, code := run(t, c, "echo alive", ""); code != 0 || out != "alive\n" {
		t.Fatalf("after idling: %d %q", code, out)
	}
	f.agent.lock.mu.Lock()
	holder := f.agent.lock.holder
	f.agent.lock.mu.Unlock()
	if holder == 0 {
		t.Fatal("an idle client that answers keepalives lost its lock")
	}
}

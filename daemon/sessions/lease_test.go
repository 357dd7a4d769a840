package sessions

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/localcloud/agent"
	"github.com/sandboxd/sandboxd/store"
)

// startAgent runs a real sandbox agent and returns the pool target to it.
func startAgent(t *testing.T) (*agent.Agent, sshpool.Target) {
	t.Helper()
	return startAgentEnv(t, []string{"PATH=/usr/bin:/bin"})
}

// startAgentEnv is startAgent with the commands' environment env.
func startAgentEnv(t *testing.T, env []string) (*agent.Agent, sshpool.Target) {
	t.Helper()
	return startAgentIn(t, t.TempDir(), env)
}

// startAgentIn is startAgentEnv with the workspace dir.
func startAgentIn(t *testing.T, dir string, env []string) (*agent.Agent, sshpool.Target) {
	t.Helper()
	_, hostPriv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	host, err := ssh.NewSignerFromKey(hostPriv)
	if err != nil {
		t.Fatal(err)
	}
	userPub, userPriv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	block, err := ssh.MarshalPrivateKey(userPriv, "")
	if err != nil {
		t.Fatal(err)
	}
	authorized, err := ssh.NewPublicKey(userPub)
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.Start(agent.Config{HostKey: host, AuthorizedKey: authorized, Workspace: dir, Env: env})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return a, sshpool.Target{RunID: "run-lease", Address: a.Addr(), PublicHostKey: string(ssh.MarshalAuthorizedKey(host.PublicKey())), PrivateUserKey: string(pem.EncodeToMemory(block))}
}

// Issue 9: the agent lock belongs to the connection that took it, so a
// command that could not be sent on that connection (it broke) is retried
// only after the lock is taken on the new one, never on a fresh connection
// without it.
func TestLockedConnRelocksBeforeTheRetry(t *testing.T) {
	a, target := startAgent(t)
	down := make(chan struct{}, 4)
	pool := sshpool.New(sshpool.Options{OnState: func(_ string, up bool, _ error) {
		if !up {
			down <- struct{}{}
		}
	}})
	defer pool.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	lock := func(c *sshpool.Conn) {
		if st, err := c.ExecOnce(ctx, directiveLock, sshpool.Stdio{}); err != nil || st.Code != 0 {
			t.Fatalf("lock: %v %+v", err, st)
		}
	}
	link := pool.NewLink(nil)
	first, err := link.Get(ctx, target)
	if err != nil {
		t.Fatal(err)
	}
	lock(first)
	// The connection holding the lock breaks between two commands.
	a.DropConnections()
	select {
	case <-down:
	case <-ctx.Done():
		t.Fatal("the pool never saw the connection drop")
	}

	relocks := 0
	lc := &sshpool.Locked{Conn: first, Relock: func(ctx context.Context) (*sshpool.Conn, error) {
		relocks++
		c, err := link.Get(ctx, target)
		if err != nil {
			return nil, err
		}
		lock(c)
		return c, nil
	}}
	before := a.Stats().Connections
	if st, err := lc.Exec(ctx, "true", sshpool.Stdio{}); err != nil || st.Code != 0 {
		t.Fatalf("exec after the drop: %v %+v", err, st)
	}
	if relocks != 1 || lc.Conn == first {
		t.Fatalf("the command was retried with %d lock requests on a new connection (want 1)", relocks)
	}
	// Exactly one new connection: the one that took the lock ran the command.
	if got := a.Stats().Connections - before; got != 1 {
		t.Fatalf("%d new connections, want 1", got)
	}
}

// leaseManager is a manager whose pool reaches the real agent of target,
// with a clock the test moves and an idle release that never comes by
// itself.
func leaseManager(t *testing.T, target sshpool.Target) (*Manager, *store.Session, *leaseClock) {
	t.Helper()
	clock := &leaseClock{t: time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)}
	st, err := store.Open(context.Background(), filepath.Join(t.TempDir(), "sandboxd.db"), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	pool := sshpool.New(sshpool.Options{})
	t.Cleanup(func() { pool.Close() })
	m, err := New(Options{Store: st, Remotes: fakeSource{}, Pool: Links(pool), Sync: nopSync{}, Events: nopEvents{}, Branches: fixedBranch{},
		LockIdle: time.Hour, Now: clock.now})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		m.Close(ctx)
	})
	s := &store.Session{RunID: target.RunID, Address: target.Address, PublicHostKey: target.PublicHostKey, PrivateUserKey: target.PrivateUserKey}
	return m, s, clock
}

// leaseClock is a clock the test moves.
type leaseClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *leaseClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *leaseClock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// waitRetaken waits until the agent has seen n more exec requests than
// before and the lease holds the lock again, with no request in flight.
func waitRetaken(t *testing.T, a *agent.Agent, before int64, n int64, m *Manager, s *store.Session) {
	t.Helper()
	l := m.leaseFor(s)
	waitUntilTrue(t, "the lock taken again after the yield", func() bool {
		l.mu.Lock()
		idle := l.acquiring == nil && l.releasing == nil && l.conn != nil
		l.mu.Unlock()
		return idle && a.Stats().ExecRequests-before >= n
	})
}

// When a burst has held the lock for lockBurstHolds × LockIdle, the lease
// yields it at the exec boundary and asks for it again at once: the next exec sends no lock
// request of its own (nor waits for an unlock).
func TestLeaseYieldsAndTakesTheLockBackBeforeTheNextExec(t *testing.T) {
	a, target := startAgent(t)
	m, s, clock := leaseManager(t, target)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	_, done, err := m.lockSandbox(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	before := a.Stats().ExecRequests
	clock.add(9 * time.Hour) // held through a burst for lockBurstHolds × LockIdle
	done()
	waitRetaken(t, a, before, 2, m, s)
	if got := a.Stats().ExecRequests - before; got != 2 {
		t.Fatalf("%d exec requests after the yield, want 2 (unlock, lock)", got)
	}
	before = a.Stats().ExecRequests
	_, done, err = m.lockSandbox(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	done()
	if got := a.Stats().ExecRequests - before; got != 0 {
		t.Fatalf("the exec after the yield sent %d requests to take the lock, want 0", got)
	}
}

// A lock request after a yield that waits behind another client is given
// up when the session stops: stopping does not wait for the other client.
func TestLeaseStopDoesNotWaitForTheRetake(t *testing.T) {
	_, target := startAgent(t)
	m, s, clock := leaseManager(t, target)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, done, err := m.lockSandbox(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	// Another client asks for the lock while the lease holds it.
	other := sshpool.New(sshpool.Options{})
	defer other.Close()
	oc, err := other.NewLink(nil).Get(ctx, target)
	if err != nil {
		t.Fatal(err)
	}
	granted := make(chan error, 1)
	go func() {
		st, err := oc.ExecOnce(ctx, directiveLock, sshpool.Stdio{})
		if err == nil && st.Code != 0 {
			err = fmt.Errorf("exit %d", st.Code)
		}
		granted <- err
	}()
	time.Sleep(100 * time.Millisecond) // the other request is queued first
	clock.add(9 * time.Hour)
	done()
	if err := <-granted; err != nil {
		t.Fatalf("the other client was not granted the lock after the yield: %v", err)
	}
	// The lease's own request now waits behind the other client, which
	// keeps the lock: stopping gives it up.
	l := m.leaseFor(s)
	waitUntilTrue(t, "the lease to ask for the lock again", func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return l.acquiring != nil
	})
	stopped := make(chan struct{})
	go func() { m.releaseNow(m.sandboxOf(s)); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("releasing the lease waited for another client's lock")
	}
}

func waitUntilTrue(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Issue 29: a burst that has held the lock for LockIdle keeps it until it
// has served lockBurstExecs execs, so that the yield's round trips land on
// a small share of its execs; the exec that completes the count yields.
func TestLeaseYieldsOnlyAfterTheBurstServedEnoughExecs(t *testing.T) {
	a, target := startAgent(t)
	m, s, clock := leaseManager(t, target)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	exec := func() {
		t.Helper()
		_, done, err := m.lockSandbox(ctx, s)
		if err != nil {
			t.Fatal(err)
		}
		done()
	}
	exec()
	clock.add(2 * time.Hour) // past LockIdle, short of lockBurstHolds × LockIdle
	before := a.Stats().ExecRequests
	for range lockBurstExecs - 2 {
		exec()
	}
	time.Sleep(200 * time.Millisecond) // a yield would have sent its unlock by now
	if got := a.Stats().ExecRequests - before; got != 0 {
		t.Fatalf("%d exec requests during a burst of %d execs, want 0 (no yield yet)", got, lockBurstExecs-1)
	}
	exec() // the lockBurstExecs-th
	waitRetaken(t, a, before, 2, m, s)
	if got := a.Stats().ExecRequests - before; got != 2 {
		t.Fatalf("%d exec requests after the yield, want 2 (unlock, lock)", got)
	}
}

package sessions

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/localcloud/agent"
)

// startAgent runs a real sandbox agent and returns the pool target to it.
func startAgent(t *testing.T) (*agent.Agent, sshpool.Target) {
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
	a, err := agent.Start(agent.Config{HostKey: host, AuthorizedKey: authorized, Workspace: t.TempDir(), Env: []string{"PATH=/usr/bin:/bin"}})
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
	first, err := pool.Get(ctx, target)
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
	lc := &lockedConn{conn: first, relock: func(ctx context.Context) (*sshpool.Conn, error) {
		relocks++
		c, err := pool.Get(ctx, target)
		if err != nil {
			return nil, err
		}
		lock(c)
		return c, nil
	}}
	before := a.Stats().Connections
	if st, err := lc.exec(ctx, "true", sshpool.Stdio{}); err != nil || st.Code != 0 {
		t.Fatalf("exec after the drop: %v %+v", err, st)
	}
	if relocks != 1 || lc.conn == first {
		t.Fatalf("the command was retried with %d lock requests on a new connection (want 1)", relocks)
	}
	// Exactly one new connection: the one that took the lock ran the command.
	if got := a.Stats().Connections - before; got != 1 {
		t.Fatalf("%d new connections, want 1", got)
	}
}

package runsapi

import (
	"context"
	"crypto/x509"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/rwxapi"
)

// silencingListener can make every connection it accepted so far go
// silent: what arrives on them is held, what is written to them is never
// sent, and they stay open, as a connection does after a sleep or a change
// of network. Connections accepted later work.
type silencingListener struct {
	net.Listener
	accepted atomic.Int32
	mu       sync.Mutex
	conns    []*silentConn
}

type silentConn struct {
	net.Conn
	silent atomic.Bool
	closed chan struct{}
	once   sync.Once
}

func (l *silencingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.accepted.Add(1)
	sc := &silentConn{Conn: c, closed: make(chan struct{})}
	l.mu.Lock()
	l.conns = append(l.conns, sc)
	l.mu.Unlock()
	return sc, nil
}

func (l *silencingListener) silenceOpenConnections() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, c := range l.conns {
		c.silent.Store(true)
	}
}

// closeAll ends every connection, silent or not, so that the server can
// shut down.
func (l *silencingListener) closeAll() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, c := range l.conns {
		c.Close()
	}
}

func (c *silentConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if c.silent.Load() {
		<-c.closed
		return 0, net.ErrClosed
	}
	return n, err
}

func (c *silentConn) Write(p []byte) (int, error) {
	if c.silent.Load() {
		<-c.closed
		return 0, net.ErrClosed
	}
	return c.Conn.Write(p)
}

func (c *silentConn) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

func TestACallOnAConnectionThatWentSilentFailsOverInsteadOfWaitingOutTheTimeout(t *testing.T) {
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, rwxapi.ConnectionInfo{Sandboxable: true, Address: "10.0.0.1:22"})
	}))
	ln := &silencingListener{Listener: srv.Listener}
	srv.Listener = ln
	srv.EnableHTTP2 = true
	srv.StartTLS()
	t.Cleanup(srv.Close)
	t.Cleanup(ln.closeAll) // first: the server waits for its silent connections
	pool := x509.NewCertPool()
	pool.AddCert(srv.Certificate())
	const timeout = 20 * time.Second
	c, err := New(Options{
		BaseURL: srv.URL, Token: testToken, RootCAs: pool, Timeout: timeout,
		PingAfter: 300 * time.Millisecond, PingTimeout: 300 * time.Millisecond,
		Backoff: time.Millisecond, MaxBackoff: 4 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := c.ConnectionInfo(ctx, "run-1", ""); err != nil {
		t.Fatalf("first call: %v", err)
	}
	ln.silenceOpenConnections()
	start := time.Now()
	ci, err := c.ConnectionInfo(ctx, "run-1", "")
	took := time.Since(start)
	if err != nil {
		t.Fatalf("the call after the silence failed after %v: %v", took, err)
	}
	if ci.Address != "10.0.0.1:22" {
		t.Fatalf("answer %+v", ci)
	}
	if took > 5*time.Second {
		t.Fatalf("the call on the silent connection took %v; it should have been pinged, dropped and retried on a new connection well before the %v timeout", took, timeout)
	}
	if n := ln.accepted.Load(); n < 2 {
		t.Fatalf("%d connection(s) accepted; the retry should have opened a new one", n)
	}
	t.Logf("failed over in %v", took)
}

package daemon

import (
	"bufio"
	"context"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/ipc/ipctest"
)

// TestWatchdogPingsOnlyWhileTheStoreAnswers: the watchdog is pinged while
// the store answers; once it stops answering (closed under the daemon
// here), no ping follows and the status says why, so systemd restarts a
// daemon whose store is wedged.
func TestWatchdogPingsOnlyWhileTheStoreAnswers(t *testing.T) {
	e := newTestEnv(t)
	ip := e.runInProcess(t, func(o *Options) {
		o.Watchdog = func() (time.Duration, error) { return 40 * time.Millisecond, nil }
	})
	ip.waitNote(t, "WATCHDOG=1")
	if err := ip.svc.deps.Store.Close(); err != nil {
		t.Fatal(err)
	}
	// Notes sent before the store was closed may still be queued; from the
	// first failed check on, three more checks must fail and none ping.
	failures := 0
	timeout := time.After(20 * time.Second)
	for failures < 4 {
		select {
		case n := <-ip.notes:
			if strings.Contains(n, "store check failed") {
				failures++
			} else if failures > 0 && strings.Contains(n, "WATCHDOG=1") {
				t.Fatalf("the watchdog was pinged after the store stopped answering (note %q)", n)
			}
		case <-timeout:
			t.Fatalf("%d failed store checks reported within 20s, want 4\n%s", failures, ip.logs)
		}
	}
}

// idleActivated runs an in-process daemon as if socket-activated, with a
// 150ms idle timeout checked every 10ms; events, when set, serves the event
// stream.
func idleActivated(t *testing.T, e *testEnv, events *ipctest.Events) *inProcess {
	t.Helper()
	e.writeConfig(`{"idle_timeout": "150ms"}`)
	ln, err := net.Listen("unix", filepath.Join(e.root, "act.sock"))
	if err != nil {
		t.Fatal(err)
	}
	return e.runInProcess(t, func(o *Options) {
		o.Activation = func() ([]net.Listener, error) { return []net.Listener{ln}, nil }
		o.IdleCheckInterval = 10 * time.Millisecond
		build := o.NewServices
		o.NewServices = func(ctx context.Context, d Deps) (Services, error) {
			svc, err := build(ctx, d)
			if events != nil {
				svc.(*fakeServices).events = events
			}
			return svc, err
		}
	})
}

// stillRunning fails the test if the daemon starts stopping within d (a
// hundred idle checks against a 150ms idle timeout). Stopping shows as the
// STOPPING=1 note: Run itself would still wait for requests in flight.
func (ip *inProcess) stillRunning(t *testing.T, d time.Duration, what string) {
	t.Helper()
	timeout := time.After(d)
	for {
		select {
		case n := <-ip.notes:
			if strings.Contains(n, "STOPPING=1") {
				t.Fatalf("the daemon began an idle exit while %s: %q\n%s", what, n, ip.logs)
			}
		case err := <-ip.done:
			ip.done <- err
			t.Fatalf("the daemon exited as idle while %s: %v\n%s", what, err, ip.logs)
		case <-timeout:
			return
		}
	}
}

// TestIdleExitWaitsForInFlightRequests: a socket-activated daemon does not
// exit as idle while a request is being handled, and does once it is over.
func TestIdleExitWaitsForInFlightRequests(t *testing.T) {
	e := newTestEnv(t)
	ip := idleActivated(t, e, nil)
	answered := make(chan error, 1)
	go func() {
		_, _, err := get(context.Background(), filepath.Join(e.root, "act.sock"), "/v1/sessions")
		answered <- err
	}()
	<-ip.svc.sessions.started
	ip.stillRunning(t, time.Second, "a request was in flight")
	close(ip.svc.sessions.release)
	if err := <-answered; err != nil {
		t.Fatalf("the request in flight: %v", err)
	}
	ip.waitNote(t, "STOPPING=1")
	if err := ip.wait(t); err != nil {
		t.Fatal(err)
	}
}

// TestIdleExitWaitsForOpenStreams: nor while a client follows the event
// stream (and nothing else happens); once the client leaves, it exits.
func TestIdleExitWaitsForOpenStreams(t *testing.T) {
	e := newTestEnv(t)
	events := ipctest.NewEvents()
	ip := idleActivated(t, e, events)
	conn, err := net.Dial("unix", filepath.Join(e.root, "act.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte("GET /v1/events HTTP/1.1\r\nHost: sandboxd\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("event stream: %v %v", resp, err)
	}
	ip.stillRunning(t, time.Second, "an event stream was open")
	conn.Close()
	ip.waitNote(t, "STOPPING=1")
	if err := ip.wait(t); err != nil {
		t.Fatal(err)
	}
}

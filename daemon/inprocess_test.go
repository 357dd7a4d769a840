package daemon

import (
	"context"
	"errors"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/daemon/config"
	"github.com/sandboxd/sandboxd/internal/testutil"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/server"
)

// slowSessions is a session backend whose List blocks until released or
// until its context ends; the other methods are not used by these tests.
type slowSessions struct {
	server.SessionBackend
	started chan struct{}
	release chan struct{}
}

func (s *slowSessions) List(ctx context.Context, _ ipc.ListRequest) (ipc.ListResponse, error) {
	s.started <- struct{}{}
	select {
	case <-s.release:
		return ipc.ListResponse{Sessions: []ipc.SessionInfo{{ID: "slow-one"}}}, nil
	case <-ctx.Done():
		return ipc.ListResponse{}, ctx.Err()
	}
}

// fakeServices records what the lifecycle does to the services.
type fakeServices struct {
	sessions *slowSessions
	events   server.EventSource // nil: no event stream
	live     atomic.Int64
	reloads  chan config.Config
	closed   atomic.Bool
	deps     Deps
}

func newFakeServices() *fakeServices {
	return &fakeServices{
		sessions: &slowSessions{started: make(chan struct{}, 4), release: make(chan struct{})},
		reloads:  make(chan config.Config, 4),
	}
}

func (f *fakeServices) Sessions() server.SessionBackend { return f.sessions }
func (f *fakeServices) Events() server.EventSource      { return f.events }
func (f *fakeServices) Live() int                       { return int(f.live.Load()) }
func (f *fakeServices) Close(context.Context) error     { f.closed.Store(true); return nil }
func (f *fakeServices) Reload(_ context.Context, c config.Config) error {
	f.reloads <- c
	return nil
}

// testServer is the socket API's server, as cmd/sandboxd plugs it in.
func testServer(c ServerConfig) Server {
	return server.New(c.Backends, server.Options{Version: c.Version, Logger: c.Logger, AllowedUID: &c.AllowedUID, StartedAt: c.StartedAt, Warning: c.Warning})
}

// inProcess is a daemon run inside the test process.
type inProcess struct {
	e       *testEnv
	svc     *fakeServices
	signals chan os.Signal
	notes   chan string
	logs    *testutil.LockedBuffer
	done    chan error
}

func (e *testEnv) runInProcess(t *testing.T, mod func(*Options)) *inProcess {
	t.Helper()
	ip := &inProcess{e: e, svc: newFakeServices(), signals: make(chan os.Signal, 4), notes: make(chan string, 256), logs: &testutil.LockedBuffer{}, done: make(chan error, 1)}
	opts := Options{
		Version:   "inproc",
		Env:       e.lookup,
		LogOutput: ip.logs,
		Signals:   ip.signals,
		Notify:    func(s string) error { ip.notes <- s; return nil },
		Watchdog:  func() (time.Duration, error) { return 0, nil },
		NewServer: testServer,
		NewServices: func(_ context.Context, d Deps) (Services, error) {
			ip.svc.deps = d
			return ip.svc, nil
		},
	}
	if mod != nil {
		mod(&opts)
	}
	go func() { ip.done <- Run(context.Background(), opts) }()
	t.Cleanup(func() {
		select {
		case <-ip.done:
		default:
			ip.signals <- syscall.SIGTERM
			ip.signals <- syscall.SIGTERM // second signal: cut anything left
			select {
			case <-ip.done:
			case <-time.After(30 * time.Second):
				t.Error("in-process daemon did not stop")
			}
		}
		if t.Failed() {
			t.Logf("daemon log:\n%s", ip.logs)
		}
	})
	ip.waitNote(t, "READY=1")
	return ip
}

func (ip *inProcess) waitNote(t *testing.T, line string) string {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case n := <-ip.notes:
			for _, l := range strings.Split(n, "\n") {
				if l == line {
					return n
				}
			}
		case err := <-ip.done:
			ip.done <- err
			t.Fatalf("daemon returned %v before %q\n%s", err, line, ip.logs)
		case <-timeout:
			t.Fatalf("no %q notification\n%s", line, ip.logs)
		}
	}
}

func (ip *inProcess) wait(t *testing.T) error {
	t.Helper()
	select {
	case err := <-ip.done:
		ip.done <- err
		return err
	case <-time.After(20 * time.Second):
		t.Fatalf("daemon did not return\n%s", ip.logs)
		return nil
	}
}

func TestSIGTERMLetsASlowRequestFinish(t *testing.T) {
	e := newTestEnv(t)
	ip := e.runInProcess(t, nil)
	if ip.svc.deps.Store == nil || ip.svc.deps.Version != "inproc" || ip.svc.deps.Layout.Socket != e.socket() {
		t.Fatalf("services got deps %+v", ip.svc.deps)
	}

	type answer struct {
		code int
		body string
		err  error
	}
	got := make(chan answer, 1)
	go func() {
		code, body, err := get(context.Background(), e.socket(), "/v1/sessions")
		got <- answer{code, body, err}
	}()
	<-ip.svc.sessions.started

	ip.signals <- syscall.SIGTERM
	ip.waitNote(t, "STOPPING=1")
	// No new connections once stopping...
	eventually(t, 5*time.Second, "the socket to stop accepting", func() bool {
		c, err := net.Dial("unix", e.socket())
		if err == nil {
			c.Close()
		}
		return err != nil
	})
	// ...but the request in flight finishes and is answered.
	select {
	case a := <-got:
		t.Fatalf("slow request answered before it finished: %+v", a)
	case <-time.After(50 * time.Millisecond):
	}
	close(ip.svc.sessions.release)
	a := <-got
	if a.err != nil || a.code != http.StatusOK || !strings.Contains(a.body, "slow-one") {
		t.Fatalf("slow request: %d %q %v", a.code, a.body, a.err)
	}
	if err := ip.wait(t); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if !ip.svc.closed.Load() {
		t.Error("services not closed")
	}
	for _, p := range []string{e.socket(), e.stateFile("sandboxd.pid")} {
		if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left behind: %v", p, err)
		}
	}
}

func TestShutdownDeadlineCutsStuckRequests(t *testing.T) {
	e := newTestEnv(t)
	e.writeConfig(`{"shutdown_timeout": "200ms"}`)
	ip := e.runInProcess(t, nil)
	got := make(chan error, 1)
	go func() {
		_, _, err := get(context.Background(), e.socket(), "/v1/sessions")
		got <- err
	}()
	<-ip.svc.sessions.started
	start := time.Now()
	ip.signals <- syscall.SIGTERM
	if err := ip.wait(t); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("shutdown took %s with a 200ms deadline", took)
	}
	<-got // answered or cut; either way not hanging
	if !ip.svc.closed.Load() {
		t.Error("services not closed after the deadline")
	}
	if !strings.Contains(ip.logs.String(), "did not finish in time") {
		t.Errorf("cut requests not logged:\n%s", ip.logs)
	}
}

func TestSIGHUPReloadsServices(t *testing.T) {
	e := newTestEnv(t)
	ip := e.runInProcess(t, nil)
	if ip.svc.deps.Config.ReconcileInterval != config.DefaultReconcileInterval {
		t.Fatalf("services started with %v", ip.svc.deps.Config)
	}

	e.writeConfig(`{"reconcile_interval": "5s", "remote": "rwx", "rwx_access_token": "tok-123"}`)
	ip.signals <- syscall.SIGHUP
	select {
	case c := <-ip.svc.reloads:
		if c.ReconcileInterval != 5*time.Second || c.Remote != "rwx" || c.RWXAccessToken != "tok-123" {
			t.Errorf("reloaded config %v", c)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("services not reloaded")
	}
	ip.waitNote(t, "READY=1")

	e.writeConfig(`{"reconcile_interval": "5 seconds"}`)
	ip.signals <- syscall.SIGHUP
	n := ip.waitNote(t, "READY=1")
	if !strings.Contains(n, "configuration reload failed") || !strings.Contains(n, "reconcile_interval") {
		t.Errorf("status after a broken reload: %q", n)
	}
	select {
	case c := <-ip.svc.reloads:
		t.Fatalf("services reloaded with a broken config: %v", c)
	default:
	}
	mustGet(t, e.socket(), "/v1/health")

	// The services may ask for a reload themselves (config file watcher).
	e.writeConfig(`{"reconcile_interval": "7s"}`)
	ip.svc.deps.RequestReload()
	ip.svc.deps.RequestReload() // merged with the pending one, never blocks
	select {
	case c := <-ip.svc.reloads:
		if c.ReconcileInterval != 7*time.Second {
			t.Errorf("requested reload got %v", c)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("RequestReload did not reload")
	}
	if strings.Contains(ip.logs.String(), "tok-123") {
		t.Error("the token was logged")
	}
}

func TestIdleExitWaitsForLiveConnections(t *testing.T) {
	e := newTestEnv(t)
	e.writeConfig(`{"idle_timeout": "150ms"}`)
	// The listener systemd would have passed.
	ln, err := net.Listen("unix", filepath.Join(e.root, "act.sock"))
	if err != nil {
		t.Fatal(err)
	}
	ip := e.runInProcess(t, func(o *Options) {
		o.Activation = func() ([]net.Listener, error) { return []net.Listener{ln}, nil }
	})
	ip.svc.live.Store(1) // an SSH connection to a sandbox is up
	time.Sleep(600 * time.Millisecond)
	select {
	case err := <-ip.done:
		ip.done <- err
		t.Fatalf("exited while a connection was live: %v", err)
	default:
	}
	ip.svc.live.Store(0)
	n := ip.waitNote(t, "STOPPING=1")
	if !strings.Contains(n, "idle for 150ms") {
		t.Errorf("stop status %q", n)
	}
	if err := ip.wait(t); err != nil {
		t.Fatalf("Run: %v", err)
	}
}

func TestNewServicesFailure(t *testing.T) {
	e := newTestEnv(t)
	logs := &testutil.LockedBuffer{}
	err := Run(context.Background(), Options{
		Env: e.lookup, LogOutput: logs, Signals: make(chan os.Signal), Notify: func(string) error { return nil }, NewServer: testServer,
		NewServices: func(context.Context, Deps) (Services, error) { return nil, errors.New("boom") },
	})
	if err == nil || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("Run: %v", err)
	}
	for _, p := range []string{e.socket(), e.stateFile("sandboxd.pid")} {
		if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left behind after a failed start: %v", p, err)
		}
	}
	// The lock was released: the next start works.
	e.runInProcess(t, nil)
	mustGet(t, e.socket(), "/v1/health")
}

func TestNilServicesServeDaemonRoutes(t *testing.T) {
	e := newTestEnv(t)
	ip := e.runInProcess(t, func(o *Options) { o.NewServices = nil })
	mustGet(t, e.socket(), "/v1/health")
	code, body, err := get(context.Background(), e.socket(), "/v1/sessions")
	if err != nil || code != http.StatusServiceUnavailable {
		t.Fatalf("sessions without services: %d %s %v", code, body, err)
	}
	ip.signals <- syscall.SIGINT
	if err := ip.wait(t); err != nil {
		t.Fatal(err)
	}
}

func TestContextCancelStops(t *testing.T) {
	e := newTestEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	notes := make(chan string, 16)
	go func() {
		done <- Run(ctx, Options{Env: e.lookup, LogOutput: &testutil.LockedBuffer{}, Signals: make(chan os.Signal), NewServer: testServer,
			Notify: func(s string) error { notes <- s; return nil }})
	}()
	eventually(t, 10*time.Second, "the socket", func() bool {
		_, _, err := get(context.Background(), e.socket(), "/v1/version")
		return err == nil
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after ctx ended")
	}
}

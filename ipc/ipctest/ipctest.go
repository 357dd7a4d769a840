// Package ipctest runs the socket API over a real Unix socket with fake
// backends, for tests of the server, the client and nook.
package ipctest

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/server"
)

// Server is a running server.Server on a socket in its own short temp dir.
type Server struct {
	Socket   string
	Dir      string
	API      *server.Server
	Sessions *Sessions
	Events   *Events
	Daemon   *Daemon
	served   chan error
}

// Options adjust Start.
type Options struct {
	Server server.Options
	// NoSessions / NoEvents leave those backends nil (503).
	NoSessions, NoEvents bool
	// Socket is where to listen; default a socket in a new temp dir.
	Socket string
	// Mode of the socket directory and socket (0700 / 0600 by default).
	DirMode, SocketMode os.FileMode
}

// Start serves the API with fake backends until the test ends.
func Start(t testing.TB, o Options) *Server {
	t.Helper()
	dir, err := os.MkdirTemp("", "nook")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if o.DirMode != 0 {
		if err := os.Chmod(dir, o.DirMode); err != nil {
			t.Fatal(err)
		}
	}
	sock := o.Socket
	if sock == "" {
		sock = filepath.Join(dir, "s.sock")
	}
	s := &Server{Socket: sock, Dir: dir, Sessions: &Sessions{}, Events: NewEvents(), Daemon: &Daemon{}, served: make(chan error, 1)}
	ln, err := net.Listen("unix", s.Socket)
	if err != nil {
		t.Fatal(err)
	}
	mode := o.SocketMode
	if mode == 0 {
		mode = 0o600
	}
	if err := os.Chmod(s.Socket, mode); err != nil {
		t.Fatal(err)
	}
	b := server.Backends{Daemon: s.Daemon}
	if !o.NoSessions {
		b.Sessions = s.Sessions
	}
	if !o.NoEvents {
		b.Events = s.Events
	}
	s.API = server.New(b, o.Server)
	go func() { s.served <- s.API.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := s.API.Shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
		if err := <-s.served; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return s
}

// Daemon is a fake DaemonBackend.
type Daemon struct {
	mu        sync.Mutex
	shutdowns int
}

func (d *Daemon) Health(context.Context) (ipc.HealthResponse, error) {
	return ipc.HealthResponse{Status: "ok", Store: "ok"}, nil
}

func (d *Daemon) Shutdown(context.Context) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.shutdowns++
	return nil
}

// Shutdowns counts POST /v1/daemon/stop calls.
func (d *Daemon) Shutdowns() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.shutdowns
}

// Sessions is a fake SessionBackend: each method calls its func field when
// set, else answers a fixed success.
type Sessions struct {
	StartFn  func(context.Context, ipc.StartRequest) (ipc.StartResponse, error)
	ListFn   func(context.Context, ipc.ListRequest) (ipc.ListResponse, error)
	StopFn   func(context.Context, ipc.StopRequest) (ipc.StopResponse, error)
	StatusFn func(context.Context, ipc.StatusRequest) (ipc.ProbeResponse, error)
	ExecFn   func(context.Context, ipc.ExecRequest, server.ExecStream) (ipc.ExecResult, error)
	PushFn   func(context.Context, ipc.PushRequest) (ipc.PushResponse, error)
	PullFn   func(context.Context, ipc.PullRequest) (ipc.PullResponse, error)

	mu       sync.Mutex
	requests []any
}

func (s *Sessions) record(r any) {
	s.mu.Lock()
	s.requests = append(s.requests, r)
	s.mu.Unlock()
}

// Requests returns the requests received, in order.
func (s *Sessions) Requests() []any {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]any(nil), s.requests...)
}

func (s *Sessions) Start(ctx context.Context, req ipc.StartRequest) (ipc.StartResponse, error) {
	s.record(req)
	if s.StartFn != nil {
		return s.StartFn(ctx, req)
	}
	return ipc.StartResponse{Session: ipc.SessionInfo{ID: "s1", RunID: "run-1", Status: "ready"}, Created: true}, nil
}

func (s *Sessions) Reset(ctx context.Context, req ipc.StartRequest) (ipc.StartResponse, error) {
	s.record(req)
	return ipc.StartResponse{Session: ipc.SessionInfo{ID: "s2", RunID: "run-2", Status: "ready"}, Created: true, Replaced: "run-1"}, nil
}

func (s *Sessions) List(ctx context.Context, req ipc.ListRequest) (ipc.ListResponse, error) {
	s.record(req)
	if s.ListFn != nil {
		return s.ListFn(ctx, req)
	}
	return ipc.ListResponse{}, nil
}

func (s *Sessions) Stop(ctx context.Context, req ipc.StopRequest) (ipc.StopResponse, error) {
	s.record(req)
	if s.StopFn != nil {
		return s.StopFn(ctx, req)
	}
	return ipc.StopResponse{}, nil
}

func (s *Sessions) Init(ctx context.Context, req ipc.InitRequest) (ipc.InitResponse, error) {
	s.record(req)
	return ipc.InitResponse{File: filepath.Join(req.Cwd, ".rwx", "sandbox.yml")}, nil
}

func (s *Sessions) Status(ctx context.Context, req ipc.StatusRequest) (ipc.ProbeResponse, error) {
	s.record(req)
	if s.StatusFn != nil {
		return s.StatusFn(ctx, req)
	}
	return ipc.ProbeResponse{Probe: "connected"}, nil
}

func (s *Sessions) Probe(ctx context.Context, id string) (ipc.ProbeResponse, error) {
	s.record(id)
	if id != "s1" {
		return ipc.ProbeResponse{}, errdefs.NotFoundf("no session %s", id)
	}
	return ipc.ProbeResponse{Session: ipc.SessionInfo{ID: id}, Probe: "connected"}, nil
}

func (s *Sessions) Config(context.Context) (ipc.ConfigResponse, error) {
	return ipc.ConfigResponse{Remote: "local", Host: "https://127.0.0.1:1"}, nil
}

func (s *Sessions) Reconcile(context.Context) error { return nil }

func (s *Sessions) Doctor(context.Context) (ipc.DoctorResponse, error) {
	return ipc.DoctorResponse{Checks: []ipc.DoctorCheck{{Name: "remote", OK: true, Detail: "local answers"}}}, nil
}

func (s *Sessions) Pull(ctx context.Context, req ipc.PullRequest) (ipc.PullResponse, error) {
	s.record(req)
	if s.PullFn != nil {
		return s.PullFn(ctx, req)
	}
	return ipc.PullResponse{RunID: "run-1", Files: []string{}}, nil
}

func (s *Sessions) Push(ctx context.Context, req ipc.PushRequest) (ipc.PushResponse, error) {
	s.record(req)
	if s.PushFn != nil {
		return s.PushFn(ctx, req)
	}
	return ipc.PushResponse{RunID: "run-1", Files: []string{}}, nil
}

func (s *Sessions) Exec(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
	s.record(req)
	if s.ExecFn != nil {
		return s.ExecFn(ctx, req, st)
	}
	return ipc.ExecResult{RunID: "run-1"}, nil
}

// Events is a fake EventSource with a bounded replay buffer.
type Events struct {
	mu     sync.Mutex
	seq    uint64
	buf    []ipc.Event
	subs   map[*sub]bool
	Buffer int // replay buffer size (default 8)
}

// NewEvents returns an empty event source.
func NewEvents() *Events { return &Events{subs: map[*sub]bool{}, Buffer: 8} }

type sub struct {
	ch     chan ipc.Event
	mu     sync.Mutex
	err    error
	closed bool
}

func (s *sub) Events() <-chan ipc.Event { return s.ch }
func (s *sub) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}
func (s *sub) end(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.closed {
		s.closed = true
		s.err = err
		close(s.ch)
	}
}

// Close is the subscriber's end.
func (s *sub) Close() { s.end(nil) }

// Subscribe replays events after since, then streams new ones.
func (e *Events) Subscribe(ctx context.Context, since *uint64) (server.EventSubscription, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	s := &sub{ch: make(chan ipc.Event, 64)}
	if since != nil {
		if len(e.buf) > 0 && *since+1 < e.buf[0].Seq {
			return nil, errdefs.Gone(errors.New("events before the requested point are gone from the buffer"))
		}
		for _, ev := range e.buf {
			if ev.Seq > *since {
				s.ch <- ev
			}
		}
	}
	e.subs[s] = true
	go func() {
		<-ctx.Done()
		e.mu.Lock()
		delete(e.subs, s)
		e.mu.Unlock()
		s.end(nil)
	}()
	return s, nil
}

// Publish appends an event and sends it to every subscriber.
func (e *Events) Publish(typ string) ipc.Event {
	return e.PublishEvent(ipc.Event{Type: typ})
}

// PublishEvent is Publish of an event with its session, run and data; Seq
// and Time are set here.
func (e *Events) PublishEvent(ev ipc.Event) ipc.Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.seq++
	ev.Seq, ev.Time = e.seq, time.Now().UTC()
	e.buf = append(e.buf, ev)
	if len(e.buf) > e.Buffer {
		e.buf = e.buf[1:]
	}
	for s := range e.subs {
		s.mu.Lock()
		if !s.closed {
			select {
			case s.ch <- ev:
			default:
			}
		}
		s.mu.Unlock()
	}
	return ev
}

// Subscribers counts live subscriptions.
func (e *Events) Subscribers() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.subs)
}

// DropAll ends every subscription with err, as the bus does to slow
// consumers.
func (e *Events) DropAll(err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for s := range e.subs {
		delete(e.subs, s)
		s.end(err)
	}
}

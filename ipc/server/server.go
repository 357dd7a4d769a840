// Package server serves sandboxd's socket API (package ipc is its wire
// contract, ipc/client the client): HTTP/1.1 over a Unix socket, routes
// under /v1 (routes.go), NDJSON streams for exec and events, each handler
// returning its error, mapped to a status once (errors.go). What it calls
// are ipc/backend's interfaces, which the daemon implements.
package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gorilla/mux"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// DefaultMaxBodyBytes bounds a request body, and each frame of an exec
// request stream.
const DefaultMaxBodyBytes = 1 << 20

// Options configure a Server. The zero value is usable.
type Options struct {
	// Version is sent in the Sandboxd-Version header and by GET /v1/version;
	// default ipc.BuildVersion().
	Version string
	// Logger defaults to discarding.
	Logger *slog.Logger
	// AllowedUID is the only peer UID served; nil means os.Getuid().
	AllowedUID *int
	// MaxBodyBytes bounds request bodies (and each exec input frame);
	// default DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// StartedAt is reported by GET /v1/version; default: NewServer's time.
	StartedAt time.Time
	// BodyIdleTimeout bounds the wait for each read of a request body (and
	// for the request line of an exec stream, not for its stdin, which may
	// rightly stay quiet): a client sending its body slowly, or not at all,
	// gets an error instead of holding the request. Default
	// DefaultBodyIdleTimeout.
	BodyIdleTimeout time.Duration
	// Warning, when set and not empty, is sent on every answer in the
	// Sandboxd-Warning header.
	Warning func() string
}

// DefaultBodyIdleTimeout is Options.BodyIdleTimeout's default.
const DefaultBodyIdleTimeout = 30 * time.Second

// Server serves the socket API.
type Server struct {
	b         Backends
	version   string
	log       *slog.Logger
	uid       int
	maxBody   int64
	startedAt time.Time
	warning   func() string

	handler http.Handler
	router  *mux.Router
	http    *http.Server

	// closing is closed when Shutdown begins: event streams end at once
	// (they never finish by themselves); exec streams run on.
	closing     chan struct{}
	closingOnce sync.Once
	// hardStop cancels every request context once the shutdown deadline
	// has passed.
	baseCtx  context.Context
	hardStop context.CancelFunc

	requests atomic.Int64
	streams  atomic.Int64
	bodyIdle time.Duration
}

// New builds the server for b. Serve it with Serve.
func New(b Backends, opts Options) *Server {
	s := &Server{
		b:         b,
		version:   opts.Version,
		log:       opts.Logger,
		uid:       os.Getuid(),
		maxBody:   opts.MaxBodyBytes,
		startedAt: opts.StartedAt,
		warning:   opts.Warning,
		closing:   make(chan struct{}),
	}
	if s.version == "" {
		s.version = ipc.BuildVersion()
	}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if opts.AllowedUID != nil {
		s.uid = *opts.AllowedUID
	}
	if s.maxBody <= 0 {
		s.maxBody = DefaultMaxBodyBytes
	}
	if s.startedAt.IsZero() {
		s.startedAt = time.Now()
	}
	s.bodyIdle = opts.BodyIdleTimeout
	if s.bodyIdle <= 0 {
		s.bodyIdle = DefaultBodyIdleTimeout
	}
	s.baseCtx, s.hardStop = context.WithCancel(context.Background())
	s.router = s.routes()
	s.handler = s.middleware(s.router)
	s.http = &http.Server{
		Handler:           s.handler,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		BaseContext:       func(net.Listener) context.Context { return s.baseCtx },
		ConnContext:       withPeer,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
	}
	return s
}

// Handler is the API with all its checks. It refuses requests whose
// connection has no peer credentials, so serve it through Serve.
func (s *Server) Handler() http.Handler { return s.handler }

// Serve answers connections from ln until Shutdown. It returns nil after
// Shutdown, and the listener's error otherwise.
func (s *Server) Serve(ln net.Listener) error {
	err := s.http.Serve(ln)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// Shutdown stops accepting connections and ends event streams at once; other
// in-flight requests, exec streams included, finish until ctx ends. Then
// every request context is cancelled and the connections are cut.
func (s *Server) Shutdown(ctx context.Context) error {
	s.closingOnce.Do(func() { close(s.closing) })
	err := s.http.Shutdown(ctx)
	if err == nil {
		return nil
	}
	s.hardStop()
	_ = s.http.Close()
	return fmt.Errorf("shut down the socket API: requests still running were cut: %w", err)
}

// ActiveStreams counts open exec and event streams (for idle-exit decisions).
func (s *Server) ActiveStreams() int { return int(s.streams.Load()) }

// ActiveRequests counts requests being handled, streams included.
func (s *Server) ActiveRequests() int { return int(s.requests.Load()) }

// apiFunc is a handler that returns its error; serveAPI maps it.
type apiFunc func(w http.ResponseWriter, r *http.Request) error

func (s *Server) serveAPI(fn apiFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := fn(w, r); err != nil {
			writeError(w, r, s.log, err)
		}
	})
}

// middleware applies the checks every request goes through, in order: the
// version header (on every answer, errors included), the peer's UID, the
// browser guard and the body limit.
func (s *Server) middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.requests.Add(1)
		defer s.requests.Add(-1)
		w.Header().Set(ipc.HeaderVersion, s.version)
		if s.warning != nil {
			if msg := s.warning(); msg != "" {
				w.Header().Set(ipc.HeaderWarning, msg)
			}
		}
		p, err := peerFrom(r.Context())
		if err != nil {
			writeError(w, r, s.log, errdefs.Unauthorized(fmt.Errorf("refused: %w", err)))
			return
		}
		if p.uid != s.uid {
			s.log.Warn("refused a connection from another user", "peer_uid", p.uid, "peer_pid", p.pid, "allowed_uid", s.uid)
			writeError(w, r, s.log, errdefs.Unauthorized(fmt.Errorf("refused: the connection comes from uid %d, and sandboxd serves only its own user (uid %d)", p.uid, s.uid)))
			return
		}
		for _, h := range []string{"Origin", "Referer"} {
			if r.Header.Get(h) != "" {
				writeError(w, r, s.log, errdefs.Unauthorized(fmt.Errorf("refused: the request carries an %s header; sandboxd does not serve browsers", h)))
				return
			}
		}
		if r.ContentLength > s.maxBody && r.URL.Path != routeExec {
			writeError(w, r, s.log, errdefs.TooLarge(fmt.Errorf("the request body (%d bytes) is larger than the limit of %d bytes", r.ContentLength, s.maxBody)))
			return
		}
		if r.URL.Path != routeExec {
			// The exec body is a long-lived stream, bounded per frame instead.
			r.Body = http.MaxBytesReader(w, r.Body, s.maxBody)
			r.Body = &idleBody{ReadCloser: r.Body, rc: http.NewResponseController(w), idle: s.bodyIdle}
		}
		next.ServeHTTP(w, r)
	})
}

// trackStream counts an open stream until the returned func is called.
func (s *Server) trackStream() func() {
	s.streams.Add(1)
	return func() { s.streams.Add(-1) }
}

// idleBody gives each read of a request body a deadline of idle from its
// start: a body that stalls ends with a timeout, one that flows is never cut.
type idleBody struct {
	io.ReadCloser
	rc   *http.ResponseController
	idle time.Duration
}

func (b *idleBody) Read(p []byte) (int, error) {
	_ = b.rc.SetReadDeadline(time.Now().Add(b.idle))
	n, err := b.ReadCloser.Read(p)
	switch {
	case errors.Is(err, io.EOF):
		// The body is over: the connection is only watched for the client
		// going away now, which must not time out while the handler works.
		_ = b.rc.SetReadDeadline(time.Time{})
	case err != nil && isTimeout(err):
		// The deadline stays: the server must not wait for the rest of
		// the body before answering.
		err = errdefs.Timeout(fmt.Errorf("the request body stalled: nothing arrived for %s; send the whole body at once", b.idle))
	}
	return n, err
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

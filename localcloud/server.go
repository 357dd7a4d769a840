// Package localcloud is sandboxd-localcloud: a runs API server that speaks
// the RWX runs API over HTTPS on loopback, plus one SSH sandbox agent per
// run, with sandboxes as git checkouts on this machine. The Server is
// embeddable (tests start it in-process); the discovery helpers let
// sandboxd find a running one or start it.
package localcloud

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sandboxd/sandboxd/daemon/paths"
	"github.com/sandboxd/sandboxd/localcloud/discovery"
	"github.com/sandboxd/sandboxd/localcloud/runs"
	"github.com/sandboxd/sandboxd/localcloud/sandbox"
)

// Defaults of Config.
const (
	DefaultIdleTimeout = 8 * time.Hour
	DefaultMaxLifetime = 72 * time.Hour
	DefaultListen      = "127.0.0.1:0"
)

// Files inside the state directory.
const (
	DiscoveryFile = discovery.File
	LockFile      = "localcloud.lock"
	TokenFile     = "token"
	LogFile       = discovery.LogFile
	certDir       = "tls"
)

// defaultVersion is reported when Config.Version is empty.
const defaultVersion = "dev"

// Clock tells the time; tests inject one they can move.
type Clock = runs.Clock

// Faults are injected failures for tests; the zero value injects nothing.
type Faults struct {
	// LatencyMS is added to every runs API request.
	LatencyMS int64 `json:"latency_ms"`
	// ErrorRate5xx is the share of runs API requests answered 503.
	ErrorRate5xx float64 `json:"error_rate_5xx"`
	// DropSSH closes every agent connection when set and refuses new ones
	// while it stays set.
	DropSSH bool `json:"drop_ssh"`
	// OneWayDelayMS delays every byte of API and agent traffic each way
	// (Config.OneWayDelay sets it at start); changing it affects open
	// connections too.
	OneWayDelayMS int64 `json:"one_way_delay_ms"`
}

func (f Faults) validate() error {
	if f.LatencyMS < 0 || f.LatencyMS > 600_000 {
		return fmt.Errorf("latency_ms %d is out of range 0..600000", f.LatencyMS)
	}
	if f.OneWayDelayMS < 0 || f.OneWayDelayMS > 10_000 {
		return fmt.Errorf("one_way_delay_ms %d is out of range 0..10000", f.OneWayDelayMS)
	}
	if f.ErrorRate5xx < 0 || f.ErrorRate5xx > 1 {
		return fmt.Errorf("error_rate_5xx %v is out of range 0..1", f.ErrorRate5xx)
	}
	return nil
}

// Config of a Server.
type Config struct {
	// Dir is the state directory; $XDG_DATA_HOME/sandboxd/localcloud when
	// empty.
	Dir string
	// Listen is the HTTPS address (DefaultListen when empty); HTTPListen an
	// optional plain HTTP address ("" for none).
	Listen     string
	HTTPListen string
	// IdleTimeout ends a sandboxable run with no activity; MaxLifetime ends
	// any run. Both are fixed per run at its creation.
	IdleTimeout time.Duration
	MaxLifetime time.Duration
	// SweepInterval is how often deadlines are checked; derived from the
	// timeouts when zero.
	SweepInterval time.Duration
	Clock         Clock
	Logger        *slog.Logger
	Faults        Faults
	// Rand decides injected 5xx answers; math/rand when nil.
	Rand func() float64
	// Version reported to clients; the package default when empty.
	Version string
	// EnableFaultInjection registers the fault-injection routes
	// (/admin/faults, /admin/runs/{id}/drop-connections) and allows
	// Faults; off, a remote never fails on purpose whoever asks.
	EnableFaultInjection bool
	// AllowRemote lets Listen and HTTPListen bind beyond the loopback
	// interface; without it New refuses such an address.
	AllowRemote bool
	// OneWayDelay is added to every byte of the API's and the agents'
	// traffic, each way (a round trip grows by twice it), to measure
	// sandboxd as if the remote were far away (Faults.OneWayDelayMS; whole
	// milliseconds). Zero adds nothing.
	OneWayDelay time.Duration
	// AgentKeepaliveInterval and AgentKeepaliveCount: each agent asks its
	// clients for a sign of life every interval and disconnects one that
	// answered none for count intervals, releasing its lock (agent
	// defaults when zero; a negative interval sends none).
	AgentKeepaliveInterval time.Duration
	AgentKeepaliveCount    int
	// Sandbox configures the isolation of every run's commands (namespaces
	// with a loopback-only network by default); Start fails when the
	// machine cannot provide it, unless Sandbox.Isolation is "none".
	Sandbox sandbox.Options
}

// ErrAlreadyRunning is returned by Start when another server holds the
// state directory.
var ErrAlreadyRunning = errors.New("sandboxd-localcloud is already running")

// Server is a localcloud instance.
type Server struct {
	cfg       Config
	sandboxes *sandbox.Provider
	log       *slog.Logger
	token     string
	cert      tls.Certificate
	pool      *x509.CertPool
	started   time.Time

	faultsMu sync.Mutex
	faults   Faults
	silence  silencer

	apiRequests atomic.Int64

	runs      *runs.Manager
	lock      *os.File
	httpsLn   net.Listener
	httpLn    net.Listener
	servers   []*http.Server
	stopSweep context.CancelFunc
	wg        sync.WaitGroup
	closeOnce sync.Once
	closeErr  error
	done      chan struct{}
}

// New validates cfg and creates the state directory. Nothing is read or
// listened on until Start.
func New(cfg Config) (*Server, error) {
	if cfg.Dir == "" {
		l, err := paths.Resolve(paths.OSEnv)
		if err != nil {
			return nil, fmt.Errorf("find the localcloud state directory: %w", err)
		}
		cfg.Dir = l.LocalcloudDir()
	}
	dir, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return nil, fmt.Errorf("resolve the state directory %q: %w", cfg.Dir, err)
	}
	cfg.Dir = dir
	if cfg.Listen == "" {
		cfg.Listen = DefaultListen
	}
	if cfg.IdleTimeout == 0 {
		cfg.IdleTimeout = DefaultIdleTimeout
	}
	if cfg.MaxLifetime == 0 {
		cfg.MaxLifetime = DefaultMaxLifetime
	}
	if cfg.IdleTimeout < 0 || cfg.MaxLifetime < 0 {
		return nil, errors.New("idle timeout and maximum lifetime must be positive")
	}
	if cfg.SweepInterval <= 0 {
		cfg.SweepInterval = min(cfg.IdleTimeout, cfg.MaxLifetime) / 20
		cfg.SweepInterval = max(50*time.Millisecond, min(cfg.SweepInterval, 10*time.Second))
	}
	if cfg.Clock == nil {
		cfg.Clock = wallClock{}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Rand == nil {
		cfg.Rand = rand.Float64
	}
	if cfg.Version == "" {
		cfg.Version = defaultVersion
	}
	if cfg.OneWayDelay != 0 {
		cfg.Faults.OneWayDelayMS = cfg.OneWayDelay.Milliseconds()
	}
	if err := cfg.Faults.validate(); err != nil {
		return nil, fmt.Errorf("faults: %w", err)
	}
	if !cfg.EnableFaultInjection && (cfg.Faults.LatencyMS != 0 || cfg.Faults.ErrorRate5xx != 0 || cfg.Faults.DropSSH) {
		return nil, errors.New("fault injection is off: start sandboxd-localcloud with --enable-fault-injection to inject faults")
	}
	if !cfg.AllowRemote {
		for _, addr := range []string{cfg.Listen, cfg.HTTPListen} {
			if err := checkLoopback(addr); err != nil {
				return nil, err
			}
		}
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("create the state directory: %w", err)
	}
	if err := os.Chmod(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("restrict the state directory: %w", err)
	}
	return &Server{cfg: cfg, log: cfg.Logger, faults: cfg.Faults, done: make(chan struct{})}, nil
}

// checkLoopback refuses a listen address beyond this machine: the runs API
// hands out SSH keys to sandboxes that run the user's code.
func checkLoopback(addr string) error {
	if addr == "" {
		return nil
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("listen address %q: %w", addr, err)
	}
	if host == "localhost" {
		return nil
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		return nil
	}
	return fmt.Errorf("listen address %q is reachable from other machines (all interfaces or a non-loopback address): the runs API and its sandboxes would be exposed to the network; listen on 127.0.0.1:PORT, or pass --allow-remote if you really mean it", addr)
}

type wallClock struct{}

func (wallClock) Now() time.Time { return time.Now() }

// Start takes the single-instance lock, loads (or creates) the access
// token and certificate, rehydrates the runs, listens and writes the
// discovery file.
func (s *Server) Start(ctx context.Context) error {
	lock, err := acquireLock(filepath.Join(s.cfg.Dir, LockFile))
	if err != nil {
		return err
	}
	s.lock = lock
	fail := func(err error) error {
		s.Close(context.Background())
		return err
	}
	// Token and certificate are created under the lock: racing starters
	// must not each write their own.
	if s.token, err = loadOrCreateToken(filepath.Join(s.cfg.Dir, TokenFile)); err != nil {
		return fail(err)
	}
	if s.cert, s.pool, err = loadOrCreateCert(filepath.Join(s.cfg.Dir, certDir), time.Now()); err != nil {
		return fail(err)
	}
	reapLeftovers(s.cfg.Dir, s.log)
	if s.sandboxes, err = sandbox.New(ctx, s.cfg.Sandbox); err != nil {
		return fail(fmt.Errorf("isolate sandboxes: %w", err))
	}
	if n := s.sandboxes.RemovedLeftovers(); n > 0 {
		s.log.Warn("removed run cgroups left by a server that died", "count", n)
	}
	s.log.Info("sandbox isolation", "isolation", s.sandboxes.Report().Summary())
	s.runs, err = runs.Open(runs.Config{
		Sandboxes:    s.sandboxes,
		Toolchains:   s.cfg.Sandbox.Toolchains,
		Dir:          s.cfg.Dir,
		Clock:        s.cfg.Clock,
		IdleTimeout:  s.cfg.IdleTimeout,
		MaxLifetime:  s.cfg.MaxLifetime,
		RefuseSSH:    func() bool { return s.Faults().DropSSH },
		Logger:       s.log,
		WrapListener: s.wrapListener,

		AgentKeepaliveInterval: s.cfg.AgentKeepaliveInterval,
		AgentKeepaliveCount:    s.cfg.AgentKeepaliveCount,
	})
	if err != nil {
		return fail(err)
	}
	if s.httpsLn, err = net.Listen("tcp", s.cfg.Listen); err != nil {
		return fail(fmt.Errorf("listen for HTTPS on %s: %w", s.cfg.Listen, err))
	}
	if s.cfg.HTTPListen != "" {
		if s.httpLn, err = net.Listen("tcp", s.cfg.HTTPListen); err != nil {
			return fail(fmt.Errorf("listen for HTTP on %s: %w", s.cfg.HTTPListen, err))
		}
	}
	handler := s.routes()
	serve := func(ln net.Listener, tlsCfg *tls.Config) {
		srv := &http.Server{Handler: handler, TLSConfig: tlsCfg, ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug), ConnContext: withConn}
		s.servers = append(s.servers, srv)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			ln = s.wrapListener(ln)
			if tlsCfg != nil {
				ln = tls.NewListener(ln, tlsCfg)
			}
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				s.log.Error("API server stopped", "err", err)
			}
		}()
	}
	// HTTP/2, which the daemon's client prefers: its pings find a
	// connection that went silent (HTTP/1.1 has no such check).
	serve(s.httpsLn, &tls.Config{Certificates: []tls.Certificate{s.cert}, MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"}})
	if s.httpLn != nil {
		serve(s.httpLn, nil)
	}
	sweepCtx, cancel := context.WithCancel(context.Background())
	s.stopSweep = cancel
	s.wg.Add(1)
	go s.sweepLoop(sweepCtx)
	s.started = time.Now().UTC()
	if err := s.writeDiscovery(); err != nil {
		return fail(err)
	}
	s.log.Info("sandboxd-localcloud serving", "api", s.APIURL(), "http", s.HTTPURL(), "state", s.cfg.Dir, "pid", os.Getpid(), "one_way_delay", s.cfg.OneWayDelay)
	return nil
}

func (s *Server) sweepLoop(ctx context.Context) {
	defer s.wg.Done()
	t := time.NewTicker(s.cfg.SweepInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.runs.Sweep()
		}
	}
}

// Sweep checks every run's deadlines now (tests call it after moving
// their clock).
func (s *Server) Sweep() { s.runs.Sweep() }

// APIURL is the HTTPS base URL of the runs API.
func (s *Server) APIURL() string {
	if s.httpsLn == nil {
		return ""
	}
	return "https://" + s.httpsLn.Addr().String()
}

// HTTPURL is the plain HTTP base URL, or "".
func (s *Server) HTTPURL() string {
	if s.httpLn == nil {
		return ""
	}
	return "http://" + s.httpLn.Addr().String()
}

// Host is host:port of the HTTPS listener (what RWX_HOST takes).
func (s *Server) Host() string { return strings.TrimPrefix(s.APIURL(), "https://") }

// AccessToken is the token that authorizes every call.
func (s *Server) AccessToken() string { return s.token }

// CertPool trusts the server's certificate.
func (s *Server) CertPool() *x509.CertPool { return s.pool }

// CertFile is the PEM certificate (for SSL_CERT_FILE).
func (s *Server) CertFile() string { return filepath.Join(s.cfg.Dir, certDir, "cert.pem") }

// TokenFile holds the access token.
func (s *Server) TokenFile() string { return filepath.Join(s.cfg.Dir, TokenFile) }

// Dir is the state directory.
func (s *Server) Dir() string { return s.cfg.Dir }

// Runs is the run registry (tests inspect it).
func (s *Server) Runs() *runs.Manager { return s.runs }

// Faults returns the injected faults.
func (s *Server) Faults() Faults {
	s.faultsMu.Lock()
	defer s.faultsMu.Unlock()
	return s.faults
}

func (s *Server) oneWayDelay() time.Duration {
	return time.Duration(s.Faults().OneWayDelayMS) * time.Millisecond
}

// SetFaults replaces the injected faults; turning DropSSH on closes every
// agent connection.
func (s *Server) SetFaults(f Faults) error {
	if err := f.validate(); err != nil {
		return err
	}
	s.faultsMu.Lock()
	s.faults = f
	s.faultsMu.Unlock()
	if f.DropSSH && s.runs != nil {
		for _, r := range s.runs.List(runs.Filter{States: []runs.State{runs.Sandboxable}}) {
			_, _ = s.runs.DropConnections(r.ID)
		}
	}
	s.log.Info("faults set", "latency_ms", f.LatencyMS, "error_rate_5xx", f.ErrorRate5xx, "drop_ssh", f.DropSSH, "one_way_delay_ms", f.OneWayDelayMS)
	return nil
}

// Done is closed once the server has stopped.
func (s *Server) Done() <-chan struct{} { return s.done }

// Close stops serving, stops the agents and keeps the state: sandboxable
// runs come back on the next start. It is safe to call more than once.
func (s *Server) Close(ctx context.Context) error {
	s.closeOnce.Do(func() {
		var errs []error
		for _, srv := range s.servers {
			if err := srv.Shutdown(ctx); err != nil {
				srv.Close()
			}
		}
		if s.stopSweep != nil {
			s.stopSweep()
		}
		s.wg.Wait()
		if s.runs != nil {
			if err := s.runs.Close(); err != nil {
				errs = append(errs, err)
			}
		}
		if s.lock != nil {
			s.removeDiscovery()
			s.lock.Close() // releases the flock
		}
		s.closeErr = errors.Join(errs...)
		close(s.done)
	})
	return s.closeErr
}

// acquireLock takes the single-instance lock of the state directory and
// records our pid in it.
func acquireLock(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open the lock file %s: %w", path, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		b, _ := os.ReadFile(path)
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			pid := strings.TrimSpace(string(b))
			return nil, fmt.Errorf("%w (pid %s holds %s): use `sandboxd-localcloud status` or `stop`", ErrAlreadyRunning, pid, path)
		}
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return f, nil
}

// isolationReport says which protections sandboxes have (nil before Start).
func (s *Server) isolationReport() *sandbox.Report {
	if s.sandboxes == nil {
		return nil
	}
	r := s.sandboxes.Report()
	return &r
}

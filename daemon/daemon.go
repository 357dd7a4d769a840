// Package daemon is sandboxd's process lifecycle: it takes the
// single-instance lock (the store), gets its listener from systemd socket
// activation or creates its own socket, serves the socket API, talks to the
// service manager (READY, STATUS, STOPPING, WATCHDOG), reloads its
// configuration on SIGHUP, exits when idle if socket-activated, and shuts
// down gracefully on SIGTERM/SIGINT. The working parts (sessions, events)
// are plugged in through Options.NewServices, the socket API's server
// (ipc/server) through Options.NewServer.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/metrics"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/coreos/go-systemd/v22/activation"
	sddaemon "github.com/coreos/go-systemd/v22/daemon"

	"github.com/sandboxd/sandboxd/daemon/config"
	"github.com/sandboxd/sandboxd/daemon/paths"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/backend"
	"github.com/sandboxd/sandboxd/store"
)

// DefaultStoreLockTimeout is how long a starting daemon waits for the
// database lock: long enough to ride over a restart, short enough that a
// second daemon is refused at once.
const DefaultStoreLockTimeout = 250 * time.Millisecond

// Services are the working parts of the daemon behind the socket API.
type Services interface {
	// Sessions and Events are served on the socket; nil answers 503.
	Sessions() backend.SessionBackend
	Events() backend.EventSource
	// Live counts live SSH connections to sandboxes; a daemon with any is
	// not idle.
	Live() int
	// Reload applies a new configuration (SIGHUP).
	Reload(ctx context.Context, cfg config.Config) error
	// Close stops background work and closes connections, within ctx.
	Close(ctx context.Context) error
}

// Server is the socket API's server (ipc/server's), which the command
// plugs in (Options.NewServer) so that the daemon links no transport.
type Server interface {
	Serve(ln net.Listener) error
	// Shutdown stops accepting and waits, within ctx, for the requests in
	// flight.
	Shutdown(ctx context.Context) error
	ActiveRequests() int
	ActiveStreams() int
}

// ServerConfig is what the daemon gives Options.NewServer.
type ServerConfig struct {
	Backends backend.Backends
	Version  string
	Logger   *slog.Logger
	// AllowedUID is the only peer UID served.
	AllowedUID int
	StartedAt  time.Time
	// Warning, when not nil, is sent on every answer.
	Warning func() string
}

// SessionCounter is optionally implemented by Services to report the number
// of sessions in /v1/health; without it the store's count is used.
type SessionCounter interface {
	SessionCount() int
}

// HandshakeCounter is optionally implemented by Services to report the SSH
// handshakes made since start in /v1/health.
type HandshakeCounter interface {
	Handshakes() uint64
}

// Deps are what NewServices builds the services from.
type Deps struct {
	Store   *store.Store
	Config  config.Config
	Layout  paths.Layout
	Logger  *slog.Logger
	Version string
	// Env is the environment the daemon was started with.
	Env paths.Env
	// RequestReload asks the daemon to reload its configuration as SIGHUP
	// does (for a watcher of the config file). It never blocks; requests
	// made while one is pending are merged.
	RequestReload func()
}

// Options configure Run. Only Version is usually set; the rest have
// production defaults and exist for the command line and for tests.
type Options struct {
	// Version is the daemon's build version, reported on the socket.
	Version string
	// Env is the environment (paths, config overrides); nil: the process's.
	Env paths.Env
	// SocketPath overrides the socket path (--socket); it beats
	// SANDBOXD_SOCKET. Ignored when socket-activated.
	SocketPath string
	// LogLevel overrides the configured log level (--log-level) when set.
	LogLevel string
	// LogOutput receives the logs (text); default os.Stderr.
	LogOutput io.Writer
	// NewServices builds the working parts once the store is open; nil
	// serves only /v1/version and /v1/health.
	NewServices func(ctx context.Context, deps Deps) (Services, error)
	// NewServer makes the socket API's server (required).
	NewServer func(ServerConfig) Server

	// Notify sends an sd_notify state; default: $NOTIFY_SOCKET.
	Notify func(state string) error
	// Activation returns the sockets passed by systemd (nil, nil when not
	// socket-activated); default: activation.Listeners when LISTEN_FDS is
	// set.
	Activation func() ([]net.Listener, error)
	// Watchdog returns the watchdog interval (0 when off); default
	// sd_watchdog_enabled ($WATCHDOG_USEC, $WATCHDOG_PID).
	Watchdog func() (time.Duration, error)
	// Signals delivers SIGTERM, SIGINT and SIGHUP; default: the process's.
	Signals <-chan os.Signal
	// Now is the clock of idle exit and uptime; default time.Now.
	Now func() time.Time
	// StoreLockTimeout; default DefaultStoreLockTimeout.
	StoreLockTimeout time.Duration
	// IdleCheckInterval is how often idleness is sampled; default a tenth
	// of the idle timeout, between 50ms and 30s.
	IdleCheckInterval time.Duration
}

// Run runs the daemon until SIGTERM/SIGINT, ctx ends, a client asks it to
// stop, or (socket-activated only) it has been idle for the configured
// time; all of these are a clean exit (nil). It fails at once with an
// *AlreadyRunningError when another daemon holds the database.
func Run(ctx context.Context, opts Options) error {
	d, err := newDaemon(opts)
	if err != nil {
		return err
	}
	return d.run(ctx)
}

// daemon is one run of the lifecycle.
type daemon struct {
	opts     Options
	env      paths.Env
	layout   paths.Layout
	cfg      config.Config // owned by the run loop
	level    *slog.LevelVar
	levelSet bool // --log-level given: reloads keep it
	log      *slog.Logger
	notifier notifier
	now      func() time.Time

	startedAt  time.Time
	store      *store.Store
	services   Services
	srv        Server
	listeners  []net.Listener
	socketPath string
	ownSocket  bool // created by us, so removed by us
	activated  bool
	accepted   atomic.Uint64

	stopOnce  sync.Once
	stopReq   chan string   // a client asked to stop (reason)
	reloadReq chan struct{} // the services asked for a config reload
}

func newDaemon(opts Options) (*daemon, error) {
	if opts.NewServer == nil {
		return nil, errors.New("start the daemon: no socket API server given (Options.NewServer)")
	}
	d := &daemon{opts: opts, env: opts.Env, now: opts.Now, level: new(slog.LevelVar), stopReq: make(chan string, 1), reloadReq: make(chan struct{}, 1)}
	if d.env == nil {
		d.env = paths.OSEnv
	}
	if d.now == nil {
		d.now = time.Now
	}
	out := opts.LogOutput
	if out == nil {
		out = os.Stderr
	}
	d.log = slog.New(slog.NewTextHandler(out, &slog.HandlerOptions{Level: d.level}))
	send := opts.Notify
	if send == nil {
		send = sdNotify
	}
	d.notifier = notifier{send: send, log: d.log}

	layout, err := paths.Resolve(d.env)
	if err != nil {
		return nil, err
	}
	if opts.SocketPath != "" {
		abs, err := filepath.Abs(opts.SocketPath)
		if err != nil {
			return nil, fmt.Errorf("--socket %q: %w", opts.SocketPath, err)
		}
		layout.Socket = abs
	}
	d.layout = layout

	if opts.LogLevel != "" {
		lvl, err := config.ParseLogLevel(opts.LogLevel)
		if err != nil {
			return nil, fmt.Errorf("--log-level: %w", err)
		}
		d.level.Set(lvl)
		d.levelSet = true
	}
	cfg, err := config.Load(layout, d.env)
	if err != nil {
		return nil, err
	}
	d.setConfig(cfg)
	return d, nil
}

// setConfig makes cfg current and applies what the lifecycle itself uses.
func (d *daemon) setConfig(cfg config.Config) {
	d.cfg = cfg
	if !d.levelSet {
		d.level.Set(cfg.LogLevel)
	}
	for _, w := range cfg.Warnings {
		d.log.Warn("configuration: " + w)
	}
}

func (d *daemon) run(ctx context.Context) (err error) {
	sigs := d.opts.Signals
	if sigs == nil {
		ch := make(chan os.Signal, 4)
		signal.Notify(ch, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
		defer signal.Stop(ch)
		sigs = ch
	}
	d.startedAt = d.now()
	d.notifier.notify(status("starting"))

	if err := d.openStore(ctx); err != nil {
		d.notifier.notify(status("failed: " + err.Error()))
		return err
	}
	defer func() {
		if cerr := d.store.Close(); cerr != nil {
			d.log.Error("close the store", "err", cerr)
			err = errors.Join(err, cerr)
		}
	}()

	if err := d.listen(); err != nil {
		d.notifier.notify(status("failed: " + err.Error()))
		return err
	}
	pidPath := pidFile(d.layout.StateDir)
	if err := writePIDFile(pidPath, os.Getpid(), d.socketPath); err != nil {
		d.closeListeners()
		return err
	}

	if d.opts.NewServices != nil {
		svc, err := d.opts.NewServices(ctx, Deps{Store: d.store, Config: d.cfg, Layout: d.layout, Logger: d.log, Version: d.opts.Version, Env: d.env, RequestReload: d.requestReload})
		if err != nil {
			d.closeListeners()
			os.Remove(pidPath)
			err = fmt.Errorf("start the daemon's services: %w", err)
			d.notifier.notify(status("failed: " + err.Error()))
			return err
		}
		d.services = svc
	}

	backends := backend.Backends{Daemon: d}
	if d.services != nil {
		backends.Sessions, backends.Events = d.services.Sessions(), d.services.Events()
		if sp, ok := d.services.(interface{ SSH() backend.SSHBackend }); ok {
			backends.SSH = sp.SSH()
		}
	}
	srvOpts := ServerConfig{Backends: backends, Version: d.opts.Version, Logger: d.log, AllowedUID: os.Getuid(), StartedAt: d.startedAt}
	if w, ok := d.services.(interface{ Warning() string }); ok {
		srvOpts.Warning = w.Warning
	}
	d.srv = d.opts.NewServer(srvOpts)
	serveErr := make(chan error, len(d.listeners))
	for _, ln := range d.listeners {
		go func(ln net.Listener) {
			serveErr <- d.srv.Serve(activityListener{Listener: ln, accepted: &d.accepted})
		}(ln)
	}

	d.log.Info("sandboxd ready", "version", d.opts.Version, "pid", os.Getpid(), "socket", d.socketPath,
		"socket_activated", d.activated, "database", d.layout.DatabaseFile(), "config", d.cfg)
	d.notifier.notify(sddaemon.SdNotifyReady, status(d.servingStatus()))

	// The watchdog runs on its own goroutine, so that a slow reload in the
	// run loop does not miss a ping; it lasts through the shutdown.
	stopWatchdog := d.startWatchdog()
	defer stopWatchdog()

	reason, loopErr := d.loop(ctx, sigs, serveErr)
	d.shutdown(reason, sigs)
	os.Remove(pidPath)
	return loopErr
}

// openStore takes the single-instance lock by opening the database.
func (d *daemon) openStore(ctx context.Context) error {
	timeout := d.opts.StoreLockTimeout
	if timeout <= 0 {
		timeout = DefaultStoreLockTimeout
	}
	st, err := store.Open(ctx, d.layout.DatabaseFile(), store.Options{LockTimeout: timeout, Logger: d.log, Now: d.opts.Now})
	if errors.Is(err, store.ErrLocked) {
		pid, socket := readPIDFile(pidFile(d.layout.StateDir))
		return &AlreadyRunningError{PID: pid, Socket: socket, Database: d.layout.DatabaseFile()}
	}
	if err != nil {
		return err
	}
	d.store = st
	return nil
}

// listen takes the sockets systemd passed, or creates the daemon's own.
func (d *daemon) listen() error {
	activate := d.opts.Activation
	if activate == nil {
		activate = systemdListeners
	}
	lns, err := activate()
	if err != nil {
		return fmt.Errorf("take the sockets passed by systemd: %w", err)
	}
	if lns != nil {
		if lns, err = unixListeners(lns); err != nil {
			return err
		}
		d.listeners, d.activated = lns, true
		d.socketPath = lns[0].Addr().String()
		if d.opts.SocketPath != "" && d.layout.Socket != d.socketPath {
			d.log.Warn("socket-activated: serving the socket systemd passed, not --socket", "socket", d.socketPath, "ignored", d.layout.Socket)
		}
		return nil
	}
	ln, err := listenOwn(d.layout.Socket, d.layout.RuntimeDir, d.log)
	if err != nil {
		return err
	}
	d.listeners, d.socketPath, d.ownSocket = []net.Listener{ln}, d.layout.Socket, true
	return nil
}

// systemdListeners is activation.Listeners, guarded so that a daemon not
// started by systemd never looks at file descriptors it did not get.
func systemdListeners() ([]net.Listener, error) {
	if os.Getenv("LISTEN_FDS") == "" {
		return nil, nil
	}
	lns, err := activation.Listeners()
	if err != nil {
		return nil, err
	}
	if len(lns) == 0 {
		// LISTEN_PID names another process: the variables were inherited,
		// not meant for us.
		return nil, nil
	}
	return lns, nil
}

func (d *daemon) closeListeners() {
	for _, ln := range d.listeners {
		ln.Close()
	}
	if d.ownSocket {
		os.Remove(d.socketPath)
	}
}

func (d *daemon) servingStatus() string {
	return "serving on " + d.socketPath
}

// loop waits for the reason to stop, reloading on SIGHUP, pinging the
// watchdog and watching for idleness meanwhile.
func (d *daemon) loop(ctx context.Context, sigs <-chan os.Signal, serveErr <-chan error) (reason string, err error) {
	idle := newIdleTracker(d.now())
	var idleTick <-chan time.Time
	var idleTicker *time.Ticker
	resetIdle := func() {
		if idleTicker != nil {
			idleTicker.Stop()
			idleTicker, idleTick = nil, nil
		}
		if d.activated && d.cfg.IdleTimeout > 0 {
			idleTicker = time.NewTicker(d.idleCheckInterval())
			idleTick = idleTicker.C
		}
	}
	resetIdle()
	defer func() {
		if idleTicker != nil {
			idleTicker.Stop()
		}
	}()

	for {
		select {
		case <-ctx.Done():
			return "context ended", nil
		case r := <-d.stopReq:
			return r, nil
		case err := <-serveErr:
			if err == nil {
				err = errors.New("the socket API stopped serving")
			}
			d.log.Error("serving the socket failed", "err", err)
			return "serve failed", fmt.Errorf("serve on %s: %w", d.socketPath, err)
		case sig := <-sigs:
			if sig == syscall.SIGHUP {
				d.reload(ctx)
				resetIdle()
				continue
			}
			return "signal " + sig.String(), nil
		case <-d.reloadReq:
			d.reload(ctx)
			resetIdle()
		case <-idleTick:
			now := d.now()
			live := d.srv.ActiveRequests() + d.srv.ActiveStreams() + d.live()
			if idle.observe(now, live, d.accepted.Load()) >= d.cfg.IdleTimeout {
				return fmt.Sprintf("idle for %s", d.cfg.IdleTimeout), nil
			}
		}
	}
}

func (d *daemon) watchdogInterval() time.Duration {
	wd := d.opts.Watchdog
	if wd == nil {
		wd = func() (time.Duration, error) { return sddaemon.SdWatchdogEnabled(false) }
	}
	interval, err := wd()
	if err != nil {
		d.log.Warn("watchdog settings are unusable; not pinging", "err", err)
		return 0
	}
	return interval
}

// startWatchdog pings the service manager's watchdog at half its interval
// when it is on; the returned func stops it.
func (d *daemon) startWatchdog() (stop func()) {
	interval := d.watchdogInterval()
	if interval <= 0 {
		return func() {}
	}
	d.log.Debug("watchdog on", "interval", interval)
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(interval / 2)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				d.pingWatchdog()
			}
		}
	}()
	return func() { close(done); wg.Wait() }
}

// pingWatchdog tells systemd the daemon is alive, but only when the store
// answers: a daemon whose store is wedged should be restarted.
func (d *daemon) pingWatchdog() {
	if err := d.store.Ping(); err != nil {
		d.log.Error("store liveness check failed; not pinging the watchdog", "err", err)
		d.notifier.notify(status("store check failed: " + err.Error()))
		return
	}
	d.notifier.notify(sddaemon.SdNotifyWatchdog)
}

func (d *daemon) idleCheckInterval() time.Duration {
	if d.opts.IdleCheckInterval > 0 {
		return d.opts.IdleCheckInterval
	}
	return min(max(d.cfg.IdleTimeout/10, 50*time.Millisecond), 30*time.Second)
}

func (d *daemon) live() int {
	if d.services == nil {
		return 0
	}
	return d.services.Live()
}

// reload re-reads the configuration (SIGHUP). A broken file is reported
// and the running configuration kept.
func (d *daemon) reload(ctx context.Context) {
	d.notifier.notify(sddaemon.SdNotifyReloading, sddaemon.SdNotifyMonotonicUsec(), status("reloading configuration"))
	cfg, err := config.Load(d.layout, d.env)
	if err != nil {
		d.log.Error("configuration reload failed; keeping the previous configuration", "err", err)
		d.notifier.notify(sddaemon.SdNotifyReady, status(d.servingStatus()+"; configuration reload failed: "+err.Error()))
		return
	}
	d.setConfig(cfg)
	if d.services != nil {
		rctx, cancel := context.WithTimeout(ctx, d.cfg.ShutdownTimeout)
		err = d.services.Reload(rctx, cfg)
		cancel()
		if err != nil {
			d.log.Error("applying the reloaded configuration failed", "err", err)
		}
	}
	d.log.Info("configuration reloaded", "config", cfg)
	d.notifier.notify(sddaemon.SdNotifyReady, status(d.servingStatus()))
}

// shutdown stops in order: no new connections, in-flight requests finish
// (up to the shutdown timeout; a second SIGTERM/SIGINT cuts them at once),
// services close, then the socket goes, all while the store lock is held so
// that no second daemon can start on a half-removed socket.
func (d *daemon) shutdown(reason string, sigs <-chan os.Signal) {
	d.log.Info("shutting down", "reason", reason, "in_flight", d.srv.ActiveRequests())
	d.notifier.notify(sddaemon.SdNotifyStopping, status("stopping ("+reason+")"))

	ctx, cancel := context.WithTimeout(context.Background(), d.cfg.ShutdownTimeout)
	defer cancel()
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case sig := <-sigs:
				if sig != syscall.SIGHUP {
					d.log.Warn("second signal: cutting in-flight requests now", "signal", sig.String())
					cancel()
					return
				}
			}
		}
	}()

	if err := d.srv.Shutdown(ctx); err != nil {
		d.log.Warn("in-flight requests did not finish in time", "timeout", d.cfg.ShutdownTimeout, "err", err)
	}
	if d.services != nil {
		// Services get their own bound even when the requests used up the
		// shared one.
		sctx, scancel := context.WithTimeout(context.Background(), max(time.Until(deadlineOf(ctx)), 2*time.Second))
		if err := d.services.Close(sctx); err != nil {
			d.log.Warn("closing the services", "err", err)
		}
		scancel()
	}
	d.closeListeners()
	d.log.Info("stopped", "reason", reason)
}

func deadlineOf(ctx context.Context) time.Time {
	dl, _ := ctx.Deadline()
	return dl
}

// Health implements server.DaemonBackend.
func (d *daemon) Health(ctx context.Context) (ipc.HealthResponse, error) {
	h := ipc.HealthResponse{
		Status:        "ok",
		Store:         "ok",
		SocketPath:    d.socketPath,
		Database:      d.layout.DatabaseFile(),
		Activated:     d.activated,
		LiveStreams:   d.srv.ActiveStreams(),
		Connections:   d.live(),
		UptimeSeconds: d.now().Sub(d.startedAt).Seconds(),
		Goroutines:    runtime.NumGoroutine(),
	}
	// The heap that survived the last collection: garbage not yet collected
	// would hide a leak's trend in noise.
	live := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	metrics.Read(live)
	if live[0].Value.Kind() == metrics.KindUint64 {
		h.HeapBytes = live[0].Value.Uint64()
	}
	// The file as it is now: a broken edit is reported here, not only
	// in the log of the reload that refused it.
	h.Config = "ok"
	if _, err := config.Load(d.layout, d.env); err != nil {
		h.Config = err.Error() + " (sandboxd runs with the configuration it last loaded)"
	}
	n, err := d.store.Count() // one read transaction: also the liveness check
	if err != nil {
		h.Status, h.Store = "degraded", err.Error()
	}
	h.Sessions = n
	if c, ok := d.services.(SessionCounter); ok {
		h.Sessions = c.SessionCount()
	}
	if c, ok := d.services.(HandshakeCounter); ok {
		h.SSHHandshakes = c.Handshakes()
	}
	return h, nil
}

// Shutdown implements server.DaemonBackend: it asks the run loop to stop and
// returns at once, so the request that asked is answered before the server
// waits for in-flight requests.
func (d *daemon) Shutdown(ctx context.Context) error {
	d.stopOnce.Do(func() { d.stopReq <- "stop requested over the socket" })
	return nil
}

func (d *daemon) requestReload() {
	select {
	case d.reloadReq <- struct{}{}:
	default: // one is pending already
	}
}

// idleTracker measures how long nothing has been live.
type idleTracker struct {
	since    time.Time // last time something was live
	accepted uint64
}

func newIdleTracker(now time.Time) *idleTracker { return &idleTracker{since: now} }

// observe records a sample: live things now, and the count of connections
// accepted so far (a connection accepted since the last sample was activity
// even if it is over). It returns how long the daemon has been idle.
func (t *idleTracker) observe(now time.Time, live int, accepted uint64) time.Duration {
	if live > 0 || accepted != t.accepted {
		t.since, t.accepted = now, accepted
		return 0
	}
	return now.Sub(t.since)
}

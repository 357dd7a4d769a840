// Package services assembles the daemon's working parts — event bus, file
// watching, remote, SSH pool, port forwards, sync, session manager, reconcile
// loop — into the daemon.Services served on the socket.
package services

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sandboxd/sandboxd/daemon"
	"github.com/sandboxd/sandboxd/daemon/config"
	"github.com/sandboxd/sandboxd/daemon/events"
	"github.com/sandboxd/sandboxd/daemon/forward"
	"github.com/sandboxd/sandboxd/daemon/gitsync"
	"github.com/sandboxd/sandboxd/daemon/helper"
	"github.com/sandboxd/sandboxd/daemon/paths"
	"github.com/sandboxd/sandboxd/daemon/reconcile"
	"github.com/sandboxd/sandboxd/daemon/remote"
	"github.com/sandboxd/sandboxd/daemon/sessions"
	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/daemon/wake"
	"github.com/sandboxd/sandboxd/internal/helperproto"
	"github.com/sandboxd/sandboxd/internal/watch"
	"github.com/sandboxd/sandboxd/ipc/backend"
)

// Services is the running set; it implements daemon.Services.
type Services struct {
	manager  *sessions.Manager
	bus      *events.Bus
	pool     *sshpool.Pool
	forwards *forward.Manager
	remote   *remote.Provider
	watcher  *watch.Watcher
	trees    *watch.Trees
	helpers  *helper.Manager
	exeDir   string // where sandboxd-helper is looked for by default
	loop     *reconcile.Loop
	layout   remoteLayout
	log      *slog.Logger

	stopConfigWatch func()
	// probeTimeout is ssh_probe_timeout (reloadable).
	probeTimeout atomic.Int64

	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// remoteLayout is what remote settings are derived from besides the config.
type remoteLayout struct {
	localcloudDir string
}

var _ daemon.Services = (*Services)(nil)

// New builds and starts the services: rehydration and the reconcile loop run
// in the background, so the daemon is ready as soon as this returns.
func New(ctx context.Context, deps daemon.Deps) (daemon.Services, error) {
	log := deps.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Services{log: log, layout: remoteLayout{localcloudDir: deps.Layout.LocalcloudDir()}}
	s.bus = events.NewBus(events.Options{Logger: log})
	w, err := watch.New(watch.Options{Logger: log})
	if err != nil {
		return nil, fmt.Errorf("start file watching: %w", err)
	}
	s.watcher = w
	branches := watch.NewBranches(w, func(repoRoot, oldBranch, newBranch string) {
		s.bus.Publish(events.BranchChanged, "", "", map[string]string{"repoRoot": repoRoot, "from": oldBranch, "to": newBranch})
	})
	// Which paths of each synced working tree changed: a synced exec
	// looks at those only.
	s.trees = watch.NewTrees(watch.TreesOptions{Logger: log})
	s.remote = remote.New(s.remoteSettings(deps.Config), log)
	exeDir := ""
	if exe, err := os.Executable(); err == nil {
		exeDir = filepath.Dir(exe)
	}
	s.exeDir = exeDir
	ho := helperOptions(deps.Config, log, exeDir)
	ho.OnFallback = func(runID, reason string) {
		s.bus.Publish(events.HelperFallback, s.manager.SessionOfRun(runID), runID, map[string]string{"reason": reason})
	}
	s.helpers = helper.New(ho)
	pause := testPause(os.Getenv(testPauseEnv), log)

	// The pool reports connection changes and asks the manager before each
	// reconnect whether the run is still alive; the manager needs the pool,
	// so the callbacks reach the manager through s once it is built.
	s.pool = sshpool.New(sshpool.Options{
		User:   "rwx-cli",
		Logger: log,
		CheckAlive: func(ctx context.Context, runID string) error {
			return s.manager.CheckAlive(ctx, runID)
		},
		OnState: func(runID string, up bool, err error) {
			typ, data := events.ConnectionUp, map[string]string{}
			if !up {
				typ = events.ConnectionDown
				if err != nil {
					data["reason"] = err.Error()
				}
			}
			s.bus.Publish(typ, s.manager.SessionOfRun(runID), runID, data)
		},
	})
	// Port forwards dial through the manager, which knows each run's
	// connection (and follows an agent that moved).
	s.forwards = forward.New(forward.Options{Dialer: sandboxDialer{s}, Logger: log})
	m, err := sessions.New(sessions.Options{
		Store:             deps.Store,
		Remotes:           s.remote,
		Pool:              sessions.Links(s.pool),
		Sync:              gitsync.New(gitsync.Options{Logger: log, Pause: pause, Changes: s.trees}),
		Events:            s.bus,
		Branches:          branches,
		Watcher:           w,
		Forwards:          sessions.ForwardSets(s.forwards),
		Logger:            log,
		DaemonConfig:      daemonConfig(deps.Config),
		SSHDir:            sshDir(deps.Layout),
		SyncHelper:        func(c *sshpool.Conn) (string, string) { return s.helpers.For(c) },
		HelperUnavailable: func(c *sshpool.Conn) bool { return s.helpers.Unavailable(c) },
		HelperStatus:      func(c *sshpool.Conn) (bool, string) { return s.helpers.Status(c) },
		HelperStop:        func(ctx context.Context, c *sshpool.Conn) { s.helpers.Stop(ctx, c) },
		Pause:             pause,
	})
	if err != nil {
		s.helpers.Close()
		s.pool.Close()
		w.Close()
		s.trees.Close()
		return nil, err
	}
	s.manager = m

	// sandboxd's own config file: a change reloads it as SIGHUP does.
	if deps.RequestReload != nil && deps.Config.File != "" {
		// The directory is watched for the file to appear; without it the
		// watcher would fall back to polling.
		if err := os.MkdirAll(filepath.Dir(deps.Config.File), 0o700); err != nil {
			log.Warn("create the config directory", "dir", filepath.Dir(deps.Config.File), "err", err)
		}
		stop, err := w.WatchFile(deps.Config.File, deps.RequestReload)
		if err != nil {
			log.Warn("watch the config file; reload it with SIGHUP instead", "file", deps.Config.File, "err", err)
		} else {
			s.stopConfigWatch = stop
		}
	}

	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s.cancel = cancel
	m.Rehydrate(runCtx)
	s.loop = reconcile.New(passer{m}, reconcile.Options{Interval: deps.Config.ReconcileInterval, Logger: log})
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.loop.Run(runCtx)
	}()
	s.probeTimeout.Store(int64(deps.Config.SSHProbeTimeout))
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.watchWakes(runCtx)
	}()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		m.RunIdleStop(runCtx)
	}()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		m.RunExpiryPull(runCtx)
	}()
	return s, nil
}

// sandboxDialer lets the forwards reach sandboxes through the manager.
type sandboxDialer struct{ s *Services }

func (d sandboxDialer) DialSandbox(ctx context.Context, runID string, port int) (net.Conn, error) {
	return d.s.manager.DialSandbox(ctx, runID, port)
}

// passer adapts the manager to the reconcile loop.
type passer struct{ m *sessions.Manager }

func (p passer) Pass(ctx context.Context) error {
	_, err := p.m.ReconcileNow(ctx)
	return err
}

func (s *Services) remoteSettings(cfg config.Config) remote.Settings {
	bin := cfg.LocalcloudBinary
	if bin == "" {
		// Next to sandboxd first: an installed pair always matches.
		if exe, err := os.Executable(); err == nil {
			if cand := filepath.Join(filepath.Dir(exe), "sandboxd-localcloud"); fileExists(cand) {
				bin = cand
			}
		}
	}
	return remote.Settings{
		Kind:             cfg.Remote,
		Host:             cfg.RWXHost,
		Token:            cfg.RWXAccessToken,
		TokenSource:      cfg.TokenSource(),
		LocalcloudDir:    s.layout.localcloudDir,
		LocalcloudBinary: bin,
		APITimeout:       cfg.APITimeout,
	}
}

// helperOptions: the sandbox helper is sandboxd-helper next to sandboxd
// unless configured; it serves Linux sandboxes of this machine's
// architecture, the one it is built for, on every remote: it runs as one
// of the agent's managed processes, which RWX's agent and localcloud's
// both document, so one way serves both.
func helperOptions(cfg config.Config, log *slog.Logger, exeDir string) helper.Options {
	o := helper.Options{Logger: log, Platform: helper.Platform(runtime.GOOS, runtime.GOARCH)}
	next := func() string {
		if cand := filepath.Join(exeDir, helperproto.Name); exeDir != "" && fileExists(cand) {
			return cand
		}
		return ""
	}
	switch cfg.SyncHelper {
	case config.SyncHelperOff:
		return o
	case "", config.SyncHelperOn:
		o.Binary = next()
	default:
		o.Binary = cfg.SyncHelper
	}
	if o.Platform == "" {
		o.Binary = ""
	}
	return o
}

func daemonConfig(cfg config.Config) sessions.DaemonConfig {
	return sessions.DaemonConfig{File: cfg.File, ReconcileInterval: cfg.ReconcileInterval, HistoryRetention: cfg.HistoryRetention,
		LockTimeout: cfg.LockTimeout, ProbeTimeout: cfg.SSHProbeTimeout, QueueTimeout: cfg.QueueTimeout, ReattachTimeout: cfg.ReattachTimeout,
		DurableExec:      cfg.DurableExec,
		IdleStop:         cfg.EffectiveIdleStop(),
		PullBeforeExpiry: cfg.PullBeforeExpiry}
}

func fileExists(p string) bool {
	st, err := os.Stat(p)
	return err == nil && !st.IsDir()
}

// Sessions implements daemon.Services.
func (s *Services) Sessions() backend.SessionBackend { return s.manager }

// Events implements daemon.Services.
func (s *Services) Events() backend.EventSource { return s.bus }

// SSH is OpenSSH access to the sandboxes (nook ssh-config, nook proxy).
func (s *Services) SSH() backend.SSHBackend { return s.manager }

// sshDir holds the key files written for OpenSSH; none without a state
// directory.
func sshDir(l paths.Layout) string {
	if l.StateDir == "" {
		return ""
	}
	return filepath.Join(l.StateDir, "ssh")
}

// Live implements daemon.Services.
func (s *Services) Live() int { return s.pool.Live() }

// Handshakes is the number of SSH handshakes made since start.
func (s *Services) Handshakes() uint64 { return s.pool.Handshakes() }

// Reload implements daemon.Services: a changed remote applies to the next
// call; the reconcile interval applies from the next pass; a changed sync
// helper setting from each connection's next exec.
func (s *Services) Reload(ctx context.Context, cfg config.Config) error {
	s.remote.Update(s.remoteSettings(cfg))
	s.helpers.SetBinary(helperOptions(cfg, nil, s.exeDir).Binary)
	s.manager.SetDaemonConfig(daemonConfig(cfg))
	s.loop.SetInterval(cfg.ReconcileInterval)
	s.probeTimeout.Store(int64(cfg.SSHProbeTimeout))
	s.loop.Trigger()
	return nil
}

// Close implements daemon.Services.
func (s *Services) Close(ctx context.Context) error {
	if s.stopConfigWatch != nil {
		s.stopConfigWatch()
	}
	s.cancel()
	errs := []error{s.manager.Close(ctx)}
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		errs = append(errs, ctx.Err())
	}
	s.forwards.Shutdown()
	// The helpers' servers end with their exec requests, before the pool
	// closes the connections under them.
	s.helpers.Close()
	errs = append(errs, s.pool.Close(), s.watcher.Close(), s.trees.Close())
	s.bus.Close()
	return errors.Join(errs...)
}

// Warning is what every answer of the daemon warns about: a local remote
// that runs sandbox commands unisolated.
func (s *Services) Warning() string {
	if s.remote != nil && s.remote.Info().Unisolated {
		return sessions.UnisolatedWarning
	}
	return ""
}

// testPauseEnv names the crash tests' hook, read once at start:
// "<phase>:<file>" makes the daemon create file and stop there forever when
// an exec reaches phase, so a test can SIGKILL it at exactly that point.
const testPauseEnv = "SANDBOXD_TEST_PAUSE"

func testPause(spec string, log *slog.Logger) func(string) {
	phase, file, ok := strings.Cut(spec, ":")
	if !ok || phase == "" || file == "" {
		return nil
	}
	log.Warn("test hook: exec pauses forever at a phase", "phase", phase)
	return func(p string) {
		if p != phase {
			return
		}
		_ = os.WriteFile(file, []byte(p), 0o600)
		select {}
	}
}

// watchWakes probes every sandbox connection as soon as the machine wakes
// up, sandboxd runs again after a stop, or the network changes: those
// connections may have gone silent, and their keepalives would take up to
// interval + timeout to tell.
func (s *Services) watchWakes(ctx context.Context) {
	wake.New(wake.Options{
		Network: wake.InterfaceAddrs,
		Logger:  s.log,
		OnWake: func(reason string) {
			timeout := time.Duration(s.probeTimeout.Load())
			if timeout <= 0 {
				timeout = sessions.DefaultProbeTimeout
			}
			s.remote.CloseIdleConnections()
			dead := s.pool.ProbeAll(ctx, timeout)
			s.log.Info("probed the sandbox connections after a wake", "reason", reason, "silent", dead)
		},
	}).Run(ctx)
}

// Package forward owns the daemon's local port forwards: a listener on
// 127.0.0.1 per forward, grouped in one Set per sandbox (owned by that
// sandbox's controller), the Manager keeping what the sets share (the
// dialer, every open forward for the conflicts of local ports, shutdown); each accepted connection spliced to a port on the
// sandbox's loopback through the daemon's kept SSH connection. A forward is
// not tied to any client: it lives until it is closed or its run ends, and
// it needs nothing to "come back" after a reconnect, since every new local
// connection dials through whatever connection the sandbox has then.
package forward

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sort"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
)

// Dialer reaches a port on a sandbox's loopback.
type Dialer interface {
	DialSandbox(ctx context.Context, runID string, port int) (net.Conn, error)
}

// Spec says what to forward.
type Spec struct {
	RunID      string
	Name       string
	TargetPort int
	// LocalPort 0 picks a free port.
	LocalPort int
}

// Info describes an open forward.
type Info struct {
	Spec
	Active int // connections being forwarded now
}

// URL is the local address of the forward.
func (i Info) URL() string { return "http://127.0.0.1:" + strconv.Itoa(i.LocalPort) }

// Options configure a Manager.
type Options struct {
	Dialer Dialer
	Logger *slog.Logger
	// DialTimeout bounds reaching the sandbox for one connection (10s).
	DialTimeout time.Duration
	// Holder names who holds a local port (default: a /proc lookup).
	Holder func(port int) string
}

// Manager holds what the sets of forwards share. Safe for concurrent use.
type Manager struct {
	opts Options
	log  *slog.Logger

	mu     sync.Mutex
	all    map[*fwd]struct{} // every open forward, of every set
	closed bool
	wg     sync.WaitGroup
}

// Set is the forwards of one sandbox, by name. Safe for concurrent use;
// its map is guarded by the manager's mu.
type Set struct {
	m    *Manager
	fwds map[string]*fwd
}

type fwd struct {
	set    *Set
	spec   Spec
	ln     net.Listener
	ctx    context.Context
	cancel context.CancelFunc
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
}

// New returns a Manager with no forwards.
func New(opts Options) *Manager {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.DialTimeout <= 0 {
		opts.DialTimeout = 10 * time.Second
	}
	if opts.Holder == nil {
		opts.Holder = PortHolder
	}
	return &Manager{opts: opts, log: opts.Logger, all: make(map[*fwd]struct{})}
}

// NewSet returns an empty set of forwards, for one sandbox.
func (m *Manager) NewSet() *Set {
	return &Set{m: m, fwds: make(map[string]*fwd)}
}

// Open listens on the spec's local port and forwards it. An open forward of
// the same name is kept when it already does the same, else replaced. A
// local port that is taken is a conflict naming its holder.
func (set *Set) Open(spec Spec) (Info, error) {
	m := set.m
	if spec.RunID == "" || spec.Name == "" {
		return Info{}, errdefs.Invalidf("open a port forward: run id and name are required")
	}
	if spec.TargetPort < 1 || spec.TargetPort > 65535 || spec.LocalPort < 0 || spec.LocalPort > 65535 {
		return Info{}, errdefs.Invalidf("open a port forward: ports must be 1-65535 (got sandbox port %d, local port %d)", spec.TargetPort, spec.LocalPort)
	}
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return Info{}, errdefs.Unavailable(errors.New("open a port forward: the daemon is shutting down"))
	}
	old := set.fwds[spec.Name]
	if old != nil && old.spec.TargetPort == spec.TargetPort && (spec.LocalPort == 0 || spec.LocalPort == old.spec.LocalPort) {
		m.mu.Unlock()
		return old.info(), nil
	}
	// Another forward of ours on the wanted port: say which.
	if spec.LocalPort != 0 {
		for f := range m.all {
			if f != old && f.spec.LocalPort == spec.LocalPort {
				m.mu.Unlock()
				return Info{}, errdefs.Conflict(fmt.Errorf("local port %d is in use by sandboxd's forward %q of run %s: choose another --local-port, or stop that one (nook bg stop %s)", spec.LocalPort, f.spec.Name, f.spec.RunID, f.spec.Name))
			}
		}
	}
	if old != nil {
		delete(set.fwds, spec.Name)
		delete(m.all, old)
	}
	m.mu.Unlock()
	if old != nil {
		old.close()
	}
	ln, err := listen(spec.LocalPort)
	if err != nil {
		if errors.Is(err, syscall.EADDRINUSE) {
			holder := m.opts.Holder(spec.LocalPort)
			if holder == "" {
				holder = "another program (its owner could not be read)"
			}
			return Info{}, errdefs.Conflict(fmt.Errorf("local port %d is already in use by %s: choose another with --local-port, or stop that program", spec.LocalPort, holder))
		}
		return Info{}, fmt.Errorf("listen on local port %d: %w", spec.LocalPort, err)
	}
	spec.LocalPort = ln.Addr().(*net.TCPAddr).Port
	ctx, cancel := context.WithCancel(context.Background())
	f := &fwd{set: set, spec: spec, ln: ln, ctx: ctx, cancel: cancel, conns: make(map[net.Conn]struct{})}
	m.mu.Lock()
	if m.closed || set.fwds[spec.Name] != nil {
		// Closed, or a concurrent Open of the same name won.
		m.mu.Unlock()
		f.close()
		return Info{}, errdefs.Conflict(fmt.Errorf("the forward %q of run %s changed while opening it: retry", spec.Name, spec.RunID))
	}
	set.fwds[spec.Name] = f
	m.all[f] = struct{}{}
	m.wg.Add(1)
	m.mu.Unlock()
	go m.serve(f)
	m.log.Info("port forward open", "run", spec.RunID, "name", spec.Name, "local", spec.LocalPort, "target", spec.TargetPort)
	return f.info(), nil
}

func listen(port int) (net.Listener, error) {
	return net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
}

// Close closes the forward name, reporting whether there was one.
func (set *Set) Close(name string) bool {
	m := set.m
	m.mu.Lock()
	f := set.fwds[name]
	delete(set.fwds, name)
	delete(m.all, f)
	m.mu.Unlock()
	if f == nil {
		return false
	}
	f.close()
	return true
}

// CloseAll closes every forward of the set and returns what it closed.
func (set *Set) CloseAll() []Info {
	m := set.m
	m.mu.Lock()
	fs := make([]*fwd, 0, len(set.fwds))
	for name, f := range set.fwds {
		fs = append(fs, f)
		delete(set.fwds, name)
		delete(m.all, f)
	}
	m.mu.Unlock()
	out := make([]Info, 0, len(fs))
	for _, f := range fs {
		out = append(out, f.info())
		f.close()
	}
	return out
}

// Get returns the forward name.
func (set *Set) Get(name string) (Info, bool) {
	set.m.mu.Lock()
	f := set.fwds[name]
	set.m.mu.Unlock()
	if f == nil {
		return Info{}, false
	}
	return f.info(), true
}

// List returns the forwards of the set, by name.
func (set *Set) List() []Info {
	set.m.mu.Lock()
	out := make([]Info, 0, len(set.fwds))
	for _, f := range set.fwds {
		out = append(out, f.info())
	}
	set.m.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Shutdown closes every forward and waits for their connections to end.
func (m *Manager) Shutdown() {
	m.mu.Lock()
	m.closed = true
	fs := make([]*fwd, 0, len(m.all))
	for f := range m.all {
		fs = append(fs, f)
		delete(f.set.fwds, f.spec.Name)
	}
	m.all = make(map[*fwd]struct{})
	m.mu.Unlock()
	for _, f := range fs {
		f.close()
	}
	m.wg.Wait()
}

func (f *fwd) info() Info {
	f.mu.Lock()
	defer f.mu.Unlock()
	return Info{Spec: f.spec, Active: len(f.conns)}
}

// close stops listening and ends the forwarded connections.
func (f *fwd) close() {
	f.cancel()
	f.ln.Close()
	f.mu.Lock()
	for c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
}

func (f *fwd) track(c net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ctx.Err() != nil {
		return false
	}
	f.conns[c] = struct{}{}
	return true
}

func (f *fwd) untrack(c net.Conn) {
	f.mu.Lock()
	delete(f.conns, c)
	f.mu.Unlock()
	c.Close()
}

func (m *Manager) serve(f *fwd) {
	defer m.wg.Done()
	for {
		lc, err := f.ln.Accept()
		if err != nil {
			if f.ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
				m.log.Warn("port forward stopped accepting", "run", f.spec.RunID, "name", f.spec.Name, "err", err)
			}
			return
		}
		if !f.track(lc) {
			lc.Close()
			return
		}
		m.wg.Add(1)
		go m.splice(f, lc)
	}
}

// splice forwards one local connection to the sandbox port.
func (m *Manager) splice(f *fwd, lc net.Conn) {
	defer m.wg.Done()
	defer f.untrack(lc)
	ctx, cancel := context.WithTimeout(f.ctx, m.opts.DialTimeout)
	rc, err := m.opts.Dialer.DialSandbox(ctx, f.spec.RunID, f.spec.TargetPort)
	cancel()
	if err != nil {
		// The local client sees its connection closed; the reason is in
		// the daemon's log.
		m.log.Info("port forward: cannot reach the sandbox port", "run", f.spec.RunID, "name", f.spec.Name, "target", f.spec.TargetPort, "err", err)
		return
	}
	if !f.track(rc) {
		rc.Close()
		return
	}
	defer f.untrack(rc)
	done := make(chan struct{}, 2)
	go func() {
		_, _ = io.Copy(rc, lc)
		closeWrite(rc)
		done <- struct{}{}
	}()
	go func() {
		_, _ = io.Copy(lc, rc)
		closeWrite(lc)
		done <- struct{}{}
	}()
	<-done
	<-done
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
}

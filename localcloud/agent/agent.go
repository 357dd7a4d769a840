// Package agent is the SSH sandbox agent of sandboxd-localcloud: one per
// sandboxable run, listening on loopback, running commands in the run's
// workspace and implementing the RWX sandbox directives (lock, sync markers,
// end, managed background processes) and port forwards to its loopback.
package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/crypto/ssh"
)

// SSH users the agent accepts, each only with the run's own key: User is
// the one today's RWX CLI logs in as, LegacyUser the one older CLIs (and
// older sandboxd) used. RWX Cloud accepts both.
const (
	User       = "rwx-cli"
	LegacyUser = "mint-cli"
)

// Directives are exec commands the agent interprets itself instead of
// running them.
const (
	DirectiveLockRequested = "__rwx_sandbox_lock_requested__"
	DirectiveLockReleased  = "__rwx_sandbox_lock_released__"
	DirectiveSyncStart     = "__rwx_sandbox_sync_start__"
	DirectiveSyncEnd       = "__rwx_sandbox_sync_end__"
	DirectiveEnd           = "__rwx_sandbox_end__"
)

// Config describes one agent.
type Config struct {
	// Addr to listen on; "127.0.0.1:0" when empty.
	Addr string
	// HostKey identifies the agent; AuthorizedKey is the run's user key,
	// the only key accepted.
	HostKey       ssh.Signer
	AuthorizedKey ssh.PublicKey
	// Workspace is the directory commands run in; Env their whole
	// environment (the agent adds TERM for a pty and what env requests set).
	Workspace string
	Env       []string
	// RunLog receives one line per command (not its output), except between
	// the sync markers; nil discards.
	RunLog io.Writer
	Logger *slog.Logger
	// OnEnd is called (once, in its own goroutine) after
	// __rwx_sandbox_end__ has been answered.
	OnEnd func()
	// OnActivity is called whenever a session channel opens or closes.
	OnActivity func()
	// Refuse, when it returns true, makes the agent drop new connections
	// at once (fault injection).
	Refuse func() bool
	// OutputGrace bounds how long the agent waits, after a command exits,
	// for background processes that keep its stdout or stderr open; 2s
	// when zero.
	OutputGrace time.Duration
	// KeepaliveInterval is how often the agent asks each client for a sign
	// of life; a client that answers none for KeepaliveCount intervals is
	// disconnected and its lock released. DefaultKeepaliveInterval and
	// DefaultKeepaliveCount when zero; a negative interval sends none.
	KeepaliveInterval time.Duration
	KeepaliveCount    int
	// WrapListener, when set, wraps the listener (latency injection).
	WrapListener func(net.Listener) net.Listener
	// ProcessDir holds the logs of managed background processes (see
	// process.go): a directory of localcloud's outside the workspace,
	// which the sandbox sees read-only (sandbox.Spec.Logs). When empty,
	// the sandbox's log directory if it has one (LogDir), else a private
	// temporary directory removed at Close.
	ProcessDir string
	// ProcessGrace is how long a stopped background process gets between
	// TERM and KILL; 3s when zero.
	ProcessGrace time.Duration
	// Sandbox builds every command the agent runs and dials every port
	// forward (the run's isolation); plain processes of this user on this
	// machine's network when nil.
	Sandbox Sandbox
	// SFTPServers are where the sftp subsystem looks for OpenSSH's
	// sftp-server in the sandbox, in order, before $PATH;
	// DefaultSFTPServers when nil.
	SFTPServers []string
}

// Sandbox is the run's isolated environment (package localcloud/sandbox).
type Sandbox interface {
	Command(ctx context.Context, dir string, argv ...string) *exec.Cmd
	DialTCP(ctx context.Context, addr string) (net.Conn, error)
}

// command builds argv to run in the workspace, in the sandbox if any.
func (a *Agent) command(argv ...string) *exec.Cmd {
	if a.cfg.Sandbox != nil {
		return a.cfg.Sandbox.Command(context.Background(), a.cfg.Workspace, argv...)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = a.cfg.Workspace
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	return cmd
}

// terminalCommand builds argv to run in the workspace on a terminal (its
// stdin, stdout and stderr): argv leads a new session whose controlling
// terminal that is, made inside the sandbox when the sandbox can
// (TerminalCommand), so that job control inside sees its own groups.
func (a *Agent) terminalCommand(argv ...string) *exec.Cmd {
	if t, ok := a.cfg.Sandbox.(interface {
		TerminalCommand(ctx context.Context, dir string, argv ...string) *exec.Cmd
	}); ok {
		return t.TerminalCommand(context.Background(), a.cfg.Workspace, argv...)
	}
	cmd := a.command(argv...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	return cmd
}

// devRoot is where the sandbox's /dev is seen from here ("" without a
// sandbox, or one that shares this machine's).
func (a *Agent) devRoot() string {
	if r, ok := a.cfg.Sandbox.(interface{ DevRoot() string }); ok {
		return r.DevRoot()
	}
	return ""
}

// dialTCP connects to addr on the sandbox's loopback.
func (a *Agent) dialTCP(addr string) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(a.ctx, 10*time.Second)
	defer cancel()
	if a.cfg.Sandbox != nil {
		return a.cfg.Sandbox.DialTCP(ctx, addr)
	}
	var d net.Dialer
	return d.DialContext(ctx, "tcp", addr)
}

// Agent is a running SSH sandbox agent.
type Agent struct {
	cfg    Config
	ln     net.Listener
	server *ssh.ServerConfig
	lock   fifoLock
	log    *slog.Logger

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	busy   atomic.Int64
	ended  atomic.Bool

	mu      sync.Mutex
	conns   map[uint64]*ssh.ServerConn
	nextID  uint64
	history []*connState // for Stats: every connection, the oldest closed ones dropped
	total   counters
	logMu   sync.Mutex
	procs   processTable
	// tempProcessDir is the logs' directory when neither the
	// configuration nor the sandbox names one.
	tempProcessDir string
}

// maxStatsHistory bounds the connections Stats remembers.
const maxStatsHistory = 256

// ConnStats counts what one client connection asked of the agent, so that
// a benchmark can tell how many round trips a client spends per call.
type ConnStats struct {
	ID           uint64 `json:"id"`
	Remote       string `json:"remote"`
	Open         bool   `json:"open"`
	ChannelOpens int64  `json:"channel_opens"`
	ExecRequests int64  `json:"exec_requests"`
}

// Stats are the agent's counters: totals since it started, and per
// connection (open ones and the most recent closed ones, oldest first).
type Stats struct {
	Connections  int64       `json:"connections"`
	ChannelOpens int64       `json:"channel_opens"`
	ExecRequests int64       `json:"exec_requests"`
	PerConn      []ConnStats `json:"per_connection"`
}

// Stats returns the agent's counters.
func (a *Agent) Stats() Stats {
	a.mu.Lock()
	defer a.mu.Unlock()
	st := Stats{Connections: a.total.connections.Load(), ChannelOpens: a.total.channelOpens.Load(), ExecRequests: a.total.execRequests.Load()}
	st.PerConn = make([]ConnStats, 0, len(a.history))
	for _, c := range a.history {
		st.PerConn = append(st.PerConn, ConnStats{ID: c.id, Remote: c.remote, Open: !c.closed.Load(), ChannelOpens: c.channelOpens.Load(), ExecRequests: c.execRequests.Load()})
	}
	return st
}

// counters are the agent-wide totals.
type counters struct {
	connections, channelOpens, execRequests atomic.Int64
}

// track records c for Stats; the caller holds a.mu.
func (a *Agent) trackLocked(c *connState) {
	a.history = append(a.history, c)
	if len(a.history) <= maxStatsHistory {
		return
	}
	kept := a.history[:0]
	drop := len(a.history) - maxStatsHistory
	for _, x := range a.history {
		if drop > 0 && x.closed.Load() {
			drop--
			continue
		}
		kept = append(kept, x)
	}
	a.history = kept
}

// Start listens and serves until Close.
func Start(cfg Config) (*Agent, error) {
	if cfg.HostKey == nil || cfg.AuthorizedKey == nil {
		return nil, errors.New("start sandbox agent: host key and authorized user key are required")
	}
	if cfg.Workspace == "" {
		return nil, errors.New("start sandbox agent: workspace is required")
	}
	if cfg.Addr == "" {
		cfg.Addr = "127.0.0.1:0"
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.OutputGrace == 0 {
		cfg.OutputGrace = 2 * time.Second
	}
	if cfg.KeepaliveInterval == 0 {
		cfg.KeepaliveInterval = DefaultKeepaliveInterval
	}
	if cfg.KeepaliveCount <= 0 {
		cfg.KeepaliveCount = DefaultKeepaliveCount
	}
	if cfg.ProcessDir == "" {
		if l, ok := cfg.Sandbox.(interface{ LogDir() string }); ok {
			cfg.ProcessDir = l.LogDir()
		}
	}
	if cfg.ProcessDir != "" && within(cfg.ProcessDir, cfg.Workspace) {
		return nil, fmt.Errorf("start sandbox agent: the process log directory %s is inside the workspace %s, where the sandbox could plant links: put it outside", cfg.ProcessDir, cfg.Workspace)
	}
	var tempDir string
	if cfg.ProcessDir == "" {
		d, err := os.MkdirTemp("", "sandboxd-processes-")
		if err != nil {
			return nil, fmt.Errorf("start sandbox agent: create the process log directory: %w", err)
		}
		tempDir = d
	}
	want := cfg.AuthorizedKey.Marshal()
	server := &ssh.ServerConfig{
		PublicKeyCallback: func(md ssh.ConnMetadata, key ssh.PublicKey) (*ssh.Permissions, error) {
			if u := md.User(); u != User && u != LegacyUser {
				return nil, fmt.Errorf("user %q is not accepted: use %q", u, User)
			}
			if string(key.Marshal()) != string(want) {
				return nil, errors.New("public key is not the run's user key")
			}
			return &ssh.Permissions{}, nil
		},
		ServerVersion: "SSH-2.0-sandboxd-localcloud",
	}
	server.AddHostKey(cfg.HostKey)
	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		if tempDir != "" {
			os.RemoveAll(tempDir)
		}
		return nil, fmt.Errorf("start sandbox agent: listen on %s: %w", cfg.Addr, err)
	}
	if cfg.WrapListener != nil {
		ln = cfg.WrapListener(ln)
	}
	ctx, cancel := context.WithCancel(context.Background())
	a := &Agent{cfg: cfg, ln: ln, server: server, log: cfg.Logger, ctx: ctx, cancel: cancel, conns: map[uint64]*ssh.ServerConn{}, tempProcessDir: tempDir}
	if w, ok := cfg.Sandbox.(interface{ Prewarm(context.Context) }); ok {
		// The first command finds the sandbox's spawner running.
		a.wg.Add(1)
		go func() {
			defer a.wg.Done()
			w.Prewarm(ctx)
		}()
	}
	a.wg.Add(1)
	go a.acceptLoop()
	return a, nil
}

// Addr is the host:port clients connect to.
func (a *Agent) Addr() string { return a.ln.Addr().String() }

// Busy reports whether a session channel is open (a command running, a
// lock being waited for); a busy sandbox is not idle.
func (a *Agent) Busy() bool { return a.busy.Load() > 0 }

// DropConnections closes every client connection (fault injection); the
// locks they held are released. It returns how many were closed.
func (a *Agent) DropConnections() int {
	a.mu.Lock()
	conns := make([]*ssh.ServerConn, 0, len(a.conns))
	for _, c := range a.conns {
		conns = append(conns, c)
	}
	a.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
	return len(conns)
}

// Close stops listening, closes every connection, hangs up running commands
// and waits for the agent's goroutines.
func (a *Agent) Close() error {
	a.cancel()
	err := a.ln.Close()
	a.DropConnections()
	a.stopAllProcesses() // the run is over: nothing it started survives
	a.wg.Wait()
	if a.tempProcessDir != "" {
		os.RemoveAll(a.tempProcessDir)
	}
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

// within reports whether path is dir or below it.
func within(path, dir string) bool {
	rel, err := filepath.Rel(filepath.Clean(dir), filepath.Clean(path))
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

func (a *Agent) acceptLoop() {
	defer a.wg.Done()
	for {
		nc, err := a.ln.Accept()
		if err != nil {
			if a.ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
				a.log.Warn("sandbox agent stopped accepting", "err", err)
			}
			return
		}
		if a.cfg.Refuse != nil && a.cfg.Refuse() {
			nc.Close()
			continue
		}
		a.wg.Add(1)
		go a.serveConn(nc)
	}
}

func (a *Agent) serveConn(nc net.Conn) {
	defer a.wg.Done()
	_ = nc.SetDeadline(time.Now().Add(30 * time.Second)) // handshake only
	conn, chans, reqs, err := ssh.NewServerConn(nc, a.server)
	if err != nil {
		nc.Close()
		a.log.Debug("ssh handshake failed", "remote", nc.RemoteAddr(), "err", err)
		return
	}
	_ = nc.SetDeadline(time.Time{})
	a.mu.Lock()
	// Refused again after the handshake: one accepted before the fault
	// began would otherwise outlive the drop of every connection.
	if a.ctx.Err() != nil || a.cfg.Refuse != nil && a.cfg.Refuse() {
		a.mu.Unlock()
		conn.Close()
		return
	}
	a.nextID++
	id := a.nextID
	a.conns[id] = conn
	c := &connState{agent: a, id: id, remote: nc.RemoteAddr().String()}
	a.trackLocked(c)
	a.total.connections.Add(1)
	a.mu.Unlock()

	ctx, cancel := context.WithCancel(a.ctx)
	defer func() {
		c.closed.Store(true)
		cancel()
		conn.Close()
		a.lock.releaseOwner(id)
		a.mu.Lock()
		delete(a.conns, id)
		a.mu.Unlock()
	}()
	go a.keepalive(ctx, conn, id)
	go func() {
		for req := range reqs {
			// keepalive@openssh.com and friends: answer so that clients see
			// a live connection.
			if req.WantReply {
				_ = req.Reply(req.Type == "keepalive@openssh.com", nil)
			}
		}
	}()
	var sessions sync.WaitGroup
	for nch := range chans {
		c.channelOpens.Add(1)
		a.total.channelOpens.Add(1)
		if nch.ChannelType() == "direct-tcpip" {
			a.wg.Add(1)
			go a.forward(nch)
			continue
		}
		if nch.ChannelType() != "session" {
			_ = nch.Reject(ssh.UnknownChannelType, "only session channels are supported")
			continue
		}
		ch, chReqs, err := nch.Accept()
		if err != nil {
			continue
		}
		// Tracked here, in the order the channels were opened, so that an
		// exec request can wait for the requests sent before it (settle).
		q, untrack := c.track(chReqs)
		sessions.Add(1)
		go func() {
			defer sessions.Done()
			defer untrack()
			s := &session{conn: c, ch: ch, q: q}
			s.serve(ctx, chReqs)
		}()
	}
	// The connection is gone: wake lock waiters and hang up commands.
	cancel()
	sessions.Wait()
}

// connState is one client connection.
type connState struct {
	agent  *Agent
	id     uint64
	remote string

	channelOpens atomic.Int64
	execRequests atomic.Int64
	closed       atomic.Bool

	mu     sync.Mutex
	inSync bool // between sync markers: commands are not logged
	queues map[*reqQueue]struct{}
}

func (a *Agent) activity() {
	if a.cfg.OnActivity != nil {
		a.cfg.OnActivity()
	}
}

func (a *Agent) logCommand(c *connState, line string) {
	if a.cfg.RunLog == nil {
		return
	}
	c.mu.Lock()
	hidden := c.inSync
	c.mu.Unlock()
	if hidden {
		return
	}
	a.logMu.Lock()
	defer a.logMu.Unlock()
	fmt.Fprintf(a.cfg.RunLog, "%s %s\n", time.Now().UTC().Format(time.RFC3339), line)
}

func (a *Agent) end() {
	if a.ended.CompareAndSwap(false, true) && a.cfg.OnEnd != nil {
		go a.cfg.OnEnd()
	}
}

// Package sessions is the heart of sandboxd: it resolves the caller's
// session from its working directory, creates, adopts, stops and resets
// sandbox runs on the remote, and runs commands in them over the persistent
// SSH connections, one at a time per sandbox. It implements the socket API's
// session backend (backend.SessionBackend).
package sessions

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/rwxapi"

	"github.com/sandboxd/sandboxd/daemon/gitsync"
	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// Remote is the runs API as the session manager uses it
// (*runsapi.Client satisfies it).
type Remote interface {
	CreateRun(ctx context.Context, def rwxapi.RunDefinition, idempotencyKey string) (rwxapi.CreateRunResult, error)
	ConnectionInfo(ctx context.Context, runID, token string) (rwxapi.ConnectionInfo, error)
	CreateSandboxToken(ctx context.Context, runID string, expiresIn time.Duration) (rwxapi.SandboxToken, error)
	ListSandboxes(ctx context.Context) ([]rwxapi.RunSummary, error)
	ListRunsInProgress(ctx context.Context) ([]rwxapi.RunSummary, error)
	CancelRun(ctx context.Context, runID string) error
	InitTemplate(ctx context.Context) (string, error)
}

// RemoteInfo describes the effective remote (never the token).
type RemoteInfo struct {
	Name        string // "local" or "rwx"
	Host        string
	CertFile    string
	TokenSource string
	// Isolation says how the remote isolates sandboxes (empty until the
	// local remote was reached); Unisolated is true when the local remote
	// runs them unisolated (configured isolation none).
	Isolation  string
	Unisolated bool
}

// RemoteSource hands out the configured remote, starting it when it is the
// embedded local one.
type RemoteSource interface {
	Remote(ctx context.Context) (Remote, error)
	Info() RemoteInfo
}

// Pool hands out the kept SSH connections, one Link per sandbox's
// controller (Links adapts *sshpool.Pool); onState hears the link's
// connection come up and go down.
type Pool interface {
	NewLink(onState func(up bool, err error)) Link
}

// Link is one sandbox's kept SSH connection (*sshpool.Link satisfies it).
type Link interface {
	Get(ctx context.Context, t sshpool.Target) (*sshpool.Conn, error)
	Ensure(t sshpool.Target)
	Forget()
}

// Links is the Pool of an *sshpool.Pool.
func Links(p *sshpool.Pool) Pool { return sshLinks{p} }

type sshLinks struct{ p *sshpool.Pool }

func (l sshLinks) NewLink(onState func(up bool, err error)) Link { return l.p.NewLink(onState) }

// Syncer moves the working tree to the sandbox and back (*gitsync.Syncer).
type Syncer interface {
	Prepare(ctx context.Context, repoRoot, baseSHA string) (*gitsync.Patch, error)
	// PrepareExchange is Prepare for an exec that Fuse on r runs: its
	// request may leave before the patch is computed.
	PrepareExchange(ctx context.Context, r gitsync.Runner, repoRoot, baseSHA string) (*gitsync.Patch, error)
	Push(ctx context.Context, r gitsync.Runner, p *gitsync.Patch) (gitsync.PushResult, error)
	Fuse(ctx context.Context, r gitsync.Runner, p *gitsync.Patch, command string) (*gitsync.Exchange, bool, error)
	Pull(ctx context.Context, r gitsync.Runner, repoRoot string) (gitsync.PullResult, error)
	Save(ctx context.Context, r gitsync.Runner, repoRoot string) (gitsync.PullResult, error)
	// Unpulled lists the files whose edits the sandbox holds unpulled.
	Unpulled(ctx context.Context, r gitsync.Runner, repoRoot string) (files []string, saved string, err error)
}

// Publisher publishes daemon events (*events.Bus satisfies it).
type Publisher interface {
	Publish(typ, sessionID, runID string, data any) ipc.Event
}

// BranchReader returns the current branch of a repository from a cache kept
// fresh by file watching (no git subprocess on the hot path).
type BranchReader interface {
	Branch(repoRoot string) (string, error)
}

// FileWatcher calls onChange when a file's content changes.
type FileWatcher interface {
	WatchFile(path string, onChange func()) (cancel func(), err error)
}

// Options wires a Manager.
type Options struct {
	Store    *store.Store
	Remotes  RemoteSource
	Pool     Pool
	Sync     Syncer
	Events   Publisher
	Branches BranchReader
	Watcher  FileWatcher // optional: config drift is then checked per exec
	Forwards Forwards    // optional: background processes get no port forwards without it
	Logger   *slog.Logger
	Now      func() time.Time
	// GitBinary runs git on the cold paths (create, adoption); default "git".
	GitBinary string
	// WaitTimeout bounds waiting for a sandbox to become ready (default 10m).
	WaitTimeout time.Duration
	// CreateTimeout bounds one create (API calls, default 2m).
	CreateTimeout time.Duration
	// TokenTTL is the lifetime asked for scoped tokens (default 24h).
	TokenTTL time.Duration
	// SSHDir is where the OpenSSH files of `nook ssh-config` are written
	// (the state directory's ssh/); empty turns SSH access off.
	SSHDir string
	// DaemonConfig is the part of sandboxd's configuration the manager
	// uses or shows; SetDaemonConfig replaces it on a reload.
	DaemonConfig DaemonConfig
	// LockIdle is how long the agent lock stays held after an exec
	// (DefaultLockIdle when zero).
	LockIdle time.Duration
	// RelayIdle is how long a held execs' relay stays open after its
	// last exec (DefaultRelayIdle when zero).
	RelayIdle time.Duration
	// SyncHelper, optional, offers the sandbox helper of a connection
	// (daemon/helper): its file name and server instance, "" while none.
	SyncHelper func(c *sshpool.Conn) (name, instance string)
	// HelperUnavailable, optional, reports that the helper will not serve
	// on c soon (off, another platform, a failed try): a detach or an
	// attach then fails at once instead of waiting for it.
	HelperUnavailable func(c *sshpool.Conn) bool
	// HelperStatus, optional, says whether the helper serves on c, and if
	// not why (doctor; ok false: a failure worth a look).
	HelperStatus func(c *sshpool.Conn) (ok bool, detail string)
	// HelperStop, optional, stops the helper's server in c's sandbox (a
	// managed process, which outlives connections) before its run ends.
	HelperStop func(ctx context.Context, c *sshpool.Conn)
	// Pause, for crash tests only, is called at named phases of an exec
	// ("exec-after-command": the command ended, its edits not pulled).
	Pause func(phase string)
}

// DaemonConfig is the part of sandboxd's own configuration the manager uses
// (history retention) or shows in `nook config`.
type DaemonConfig struct {
	File              string
	ReconcileInterval time.Duration
	// HistoryRetention is how long ended sessions stay listed (0: forever).
	HistoryRetention time.Duration
	// LockTimeout bounds an exec's wait for the agent lock
	// (DefaultLockTimeout when zero); ProbeTimeout is how long a connection
	// may leave a keepalive unanswered while a lock request waits on it
	// (DefaultProbeTimeout when zero).
	LockTimeout  time.Duration
	ProbeTimeout time.Duration
	// QueueTimeout bounds an exec's wait for its turn in the sandbox's
	// queue (DefaultQueueTimeout when zero).
	QueueTimeout time.Duration
	// ReattachTimeout bounds a held command's wait for a new connection
	// once its own was lost (DefaultReattachTimeout when zero).
	ReattachTimeout time.Duration
	// DurableExec holds commands under the sandbox helper where it runs
	// (docs/durable-exec.md).
	DurableExec bool
	// IdleStop stops a ready sandbox unused for that long (0: never).
	IdleStop time.Duration
	// PullBeforeExpiry pulls a sandbox's edits that long before the end
	// its remote reports (0: never).
	PullBeforeExpiry time.Duration
}

// Manager implements backend.SessionBackend.
type Manager struct {
	opts Options
	st   *store.Store
	log  *slog.Logger
	now  func() time.Time
	git  gitRunner

	// helperBins: run id → the sandbox helper's file name last seen
	// serving in that sandbox (held.go).
	helperBins sync.Map

	creates    flight[*store.Session] // by identity key: one create per identity
	readies    flight[*store.Session] // by session id: one wait-for-ready poller
	reconciles flight[ReconcileReport]

	mu sync.Mutex
	// sandboxes are the controllers of the sessions, by session id: all
	// the run-time state of a sandbox (sandbox.go).
	sandboxes  map[string]*sandbox
	daemonCfg  DaemonConfig
	closing    bool              // Close began: leases are released at once, no new background work
	cliWatches map[string]func() // by repository root: watches of the RWX CLI's file
	cliWrites  map[string]*bool  // by repository root: a write in flight, and whether another is due
	cliReads   map[string]*bool  // by repository root: a read in flight, and whether another is due
	cliRefused map[string]bool   // records of the CLI's file whose run the remote did not confirm

	// expiryPull is the pull before expiry (pullBeforeStop; tests time
	// it without a sandbox).
	expiryPull func(ctx context.Context, s *store.Session) (ipc.EndEdits, error)

	wg sync.WaitGroup // background work: rehydration, exec records

	records     sync.Mutex    // guards the fields below
	recordsDone *sync.Cond    // signalled after each write of records
	pending     []*sandbox    // controllers whose exec statistics are not yet written
	writing     int           // records being written now
	flushing    bool          // flushRecords runs
	flushNow    chan struct{} // cuts flushRecords' wait short
	idleNow     chan struct{} // cuts RunIdleStop's wait short (a reload)
}

// sessionRuntime is what the daemon knows about a session beyond the store:
// runtime facts that are re-learned after a restart, never persisted.
type sessionRuntime struct {
	// checked is closed once the rehydration check of the session is done;
	// requests for the session wait on it instead of on the whole pass.
	checked     chan struct{}
	drift       bool
	driftHash   string
	driftWarned string // the config hash an exec last warned about (once per change)
	cancelWatch func()
	expiresAt   time.Time
	// pollErr is the remote's latest failure while waiting for the session
	// to become ready (nil once an answer came), pollErrs how many in a
	// row: waiters report them instead of waiting in silence.
	pollErr  error
	pollErrs int
	// idle is what the idle stop knows of the session's use (idle.go).
	idle idleState
	// expiry is the pull before the reported end's state (expiry.go).
	expiry expiryState
	// stopping is set while a stop ends the run: the connection it drops
	// is not a run that ended on its own.
	stopping bool
}

// New returns a Manager. Call Rehydrate once after New to re-learn the
// runtime facts of the stored sessions.
func New(opts Options) (*Manager, error) {
	if opts.Store == nil || opts.Remotes == nil || opts.Pool == nil || opts.Sync == nil || opts.Events == nil || opts.Branches == nil {
		return nil, errors.New("sessions: store, remotes, pool, sync, events and branches are required")
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.GitBinary == "" {
		opts.GitBinary = "git"
	}
	if opts.WaitTimeout <= 0 {
		opts.WaitTimeout = 10 * time.Minute
	}
	if opts.CreateTimeout <= 0 {
		opts.CreateTimeout = 2 * time.Minute
	}
	if opts.TokenTTL <= 0 {
		opts.TokenTTL = 24 * time.Hour
	}
	if opts.LockIdle <= 0 {
		opts.LockIdle = DefaultLockIdle
	}
	if opts.RelayIdle <= 0 {
		opts.RelayIdle = DefaultRelayIdle
	}
	m := &Manager{
		opts:       opts,
		st:         opts.Store,
		log:        opts.Logger,
		now:        opts.Now,
		git:        gitRunner{binary: opts.GitBinary},
		sandboxes:  make(map[string]*sandbox),
		daemonCfg:  opts.DaemonConfig,
		cliWatches: make(map[string]func()),
		cliWrites:  make(map[string]*bool),
		cliRefused: make(map[string]bool),
		cliReads:   make(map[string]*bool),
	}
	m.expiryPull = m.pullBeforeStop
	m.recordsDone = sync.NewCond(&m.records)
	m.flushNow = make(chan struct{}, 1)
	m.idleNow = make(chan struct{}, 1)
	return m, nil
}

// rt returns the runtime record of a session, creating its controller on
// first use.
func (m *Manager) rt(id string) *sessionRuntime {
	m.mu.Lock()
	defer m.mu.Unlock()
	return &m.sandboxLocked(id).rt
}

// dropRuntime forgets the controller of an ended session and ends it.
func (m *Manager) dropRuntime(id string) {
	m.mu.Lock()
	c := m.sandboxes[id]
	delete(m.sandboxes, id)
	var cancelWatch func()
	if c != nil {
		cancelWatch, c.rt.cancelWatch = c.rt.cancelWatch, nil
	}
	m.mu.Unlock()
	if cancelWatch != nil {
		cancelWatch()
	}
	if c == nil {
		return
	}
	c.setState(stateEnded, "the session ended")
	c.link.Forget()
	// Joined by Close, not here: the session may be ended from the
	// controller's own loop (a yield's reconnect that finds the run over),
	// which end waits for.
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		c.end("the session ended")
	}()
}

// remote returns the configured remote client.
func (m *Manager) remote(ctx context.Context) (Remote, error) {
	r, err := m.opts.Remotes.Remote(ctx)
	if err != nil {
		if errdefs.KindOf(err) == errdefs.KindInternal {
			err = errdefs.Unavailable(err)
		}
		return nil, fmt.Errorf("reach the remote: %w", err)
	}
	return r, nil
}

// target is the SSH pool target of a ready session.
func target(s *store.Session) sshpool.Target {
	return sshpool.Target{RunID: s.RunID, Address: s.Address, PublicHostKey: s.PublicHostKey, PrivateUserKey: s.PrivateUserKey}
}

// publish emits an event for a session.
func (m *Manager) publish(typ string, s *store.Session, data any) {
	m.opts.Events.Publish(typ, s.ID, s.RunID, data)
}

// progress publishes a phase of session s's start, for the clients waiting
// on it (nook shows them) and for `nook events`.
func (m *Manager) progress(s *store.Session, phase, message string) {
	m.publish(eventProgress, s, ipc.Progress{Phase: phase, Message: message, RunURL: m.browserURL(s.RunURL), RepoRoot: s.RepoRoot, Branch: s.Branch, ConfigFile: s.ConfigFile})
}

// info is the public view of a session.
func (m *Manager) info(s *store.Session) ipc.SessionInfo {
	in := ipc.SessionInfo{
		ID:         s.ID,
		RunID:      s.RunID,
		RunURL:     m.browserURL(s.RunURL),
		Status:     string(s.State),
		Reason:     s.StateReason,
		RepoRoot:   s.RepoRoot,
		Branch:     s.Branch,
		ConfigFile: s.ConfigFile,
		Remote:     s.Remote,
		CreatedAt:  s.CreatedAt,
		ExecCount:  s.ExecCount,
		Adopted:    s.Adopted,
	}
	if !s.LastExecAt.IsZero() {
		t := s.LastExecAt
		in.LastExecAt = &t
	}
	if !s.EndedAt.IsZero() {
		t := s.EndedAt
		in.EndedAt = &t
	}
	if !s.State.Terminal() {
		in.Forwards = m.forwardInfos(s)
	}
	in.Kept = s.Kept
	m.idleInfo(s, &in)
	m.expiryInfo(s, &in)
	m.mu.Lock()
	if r, ok := m.runtimeLocked(s.ID); ok {
		in.ConfigDrift = r.drift
		if r.checked != nil && !isClosed(r.checked) && !s.State.Terminal() {
			in.Status = string(store.StateUnknown)
		}
	}
	m.mu.Unlock()
	return in
}

func isClosed(c chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// SetDaemonConfig applies a reloaded daemon configuration.
func (m *Manager) SetDaemonConfig(c DaemonConfig) {
	m.mu.Lock()
	m.daemonCfg = c
	m.mu.Unlock()
	// The idle loop may wait out a tick of the old idle_stop (up to 15 s).
	select {
	case m.idleNow <- struct{}{}:
	default:
	}
}

// Config reports the effective remote (never the token) and where the
// daemon's configuration comes from.
func (m *Manager) Config(ctx context.Context) (ipc.ConfigResponse, error) {
	ri := m.opts.Remotes.Info()
	m.mu.Lock()
	dc := m.daemonCfg
	m.mu.Unlock()
	return ipc.ConfigResponse{
		Remote: ri.Name, Host: ri.Host, TokenSource: ri.TokenSource, CertFile: ri.CertFile,
		ConfigFile: dc.File, ReconcileIntervalSeconds: dc.ReconcileInterval.Seconds(), IdleStopSeconds: dc.IdleStop.Seconds(),
	}, nil
}

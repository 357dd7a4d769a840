package runs

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/rwxapi"

	"github.com/sandboxd/sandboxd/localcloud/agent"
	"github.com/sandboxd/sandboxd/localcloud/provision"
	"github.com/sandboxd/sandboxd/localcloud/sandbox"
)

// Clock tells the time; injected so that tests can move it.
type Clock interface{ Now() time.Time }

type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

// Config of the registry.
type Config struct {
	// Dir holds runs.json and one directory per run.
	Dir         string
	Clock       Clock
	IdleTimeout time.Duration
	MaxLifetime time.Duration
	// AgentHost is the address agents listen on; 127.0.0.1 when empty.
	AgentHost string
	// RefuseSSH makes agents drop new connections while it returns true.
	RefuseSSH func() bool
	// GitEnv is the environment of git clone (the server's own when nil).
	GitEnv []string
	Logger *slog.Logger
	Random io.Reader // crypto/rand when nil
	// WrapListener, when set, wraps each agent's listener (latency
	// injection).
	WrapListener func(net.Listener) net.Listener
	// Sandboxes isolates each run's commands; plain processes when nil.
	Sandboxes *sandbox.Provider
	// Toolchains go first on the sandbox's PATH (sandbox.ToolchainPath).
	Toolchains []string
	// AgentKeepaliveInterval and AgentKeepaliveCount: how agents detect
	// silent clients (agent.Config.KeepaliveInterval, KeepaliveCount).
	AgentKeepaliveInterval time.Duration
	AgentKeepaliveCount    int
}

// Manager owns every run.
type Manager struct {
	cfg Config
	log *slog.Logger

	mu      sync.Mutex
	runs    map[string]*entry
	byKey   map[string]string // idempotency key → id of its active run
	byToken map[string]string // token hash → run id
	closed  bool
	dirty   bool // activity not yet persisted
	wg      sync.WaitGroup
}

type entry struct {
	Run
	agent    *agent.Agent
	nook     *sandbox.Sandbox        // the run's isolation, from its setup steps to its end
	cancel   context.CancelCauseFunc // of provisioning
	logFile  *os.File
	connInfo rwxapi.ConnectionInfo // cached while sandboxable
	step     string                // what provisioning is doing now, for connection info
}

// errShutdown interrupts provisioning that resumes after a restart.
var errShutdown = errors.New("localcloud stopped")

// StateFile is the registry file name inside Dir.
const StateFile = "runs.json"

type stateFile struct {
	Version int   `json:"version"`
	Runs    []Run `json:"runs"`
}

// Open loads the registry and brings its live runs back: sandboxable runs
// get their agent again, with the same keys and, when free, the same port;
// runs whose workspace is gone complete as failed; interrupted
// provisioning starts over. A registry that cannot be read is an error
// naming the file; it is never overwritten.
func Open(cfg Config) (*Manager, error) {
	if cfg.Clock == nil {
		cfg.Clock = systemClock{}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Random == nil {
		cfg.Random = rand.Reader
	}
	if cfg.AgentHost == "" {
		cfg.AgentHost = "127.0.0.1"
	}
	if cfg.IdleTimeout <= 0 || cfg.MaxLifetime <= 0 {
		return nil, errors.New("open the run registry: idle timeout and maximum lifetime must be positive")
	}
	if err := os.MkdirAll(filepath.Join(cfg.Dir, "runs"), 0o700); err != nil {
		return nil, fmt.Errorf("open the run registry: %w", err)
	}
	m := &Manager{cfg: cfg, log: cfg.Logger, runs: map[string]*entry{}, byKey: map[string]string{}, byToken: map[string]string{}}
	path := filepath.Join(cfg.Dir, StateFile)
	b, err := os.ReadFile(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return m, nil
	case err != nil:
		return nil, fmt.Errorf("read the run registry %s: %w", path, err)
	}
	var sf stateFile
	if err := json.Unmarshal(b, &sf); err != nil {
		return nil, fmt.Errorf("the run registry %s is damaged (%v): move it away to start with no runs", path, err)
	}
	if sf.Version != 1 {
		return nil, fmt.Errorf("the run registry %s has version %d, this sandboxd-localcloud reads version 1: use a newer sandboxd-localcloud", path, sf.Version)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, r := range sf.Runs {
		e := &entry{Run: r}
		m.runs[r.ID] = e
		for _, t := range r.Tokens {
			m.byToken[t.Hash] = r.ID
		}
		if r.State != Completed && r.IdempotencyKey != "" {
			m.byKey[r.IdempotencyKey] = r.ID
		}
	}
	for _, e := range m.runs {
		switch e.State {
		case Sandboxable:
			if _, err := os.Stat(filepath.Join(m.runDir(e.ID), "workspace", ".git")); err != nil {
				m.completeLocked(e, ReasonFailed, fmt.Sprintf("its workspace %s is gone", filepath.Join(m.runDir(e.ID), "workspace")))
				continue
			}
			if err := m.startAgentLocked(e); err != nil {
				m.completeLocked(e, ReasonFailed, fmt.Sprintf("its sandbox agent could not start again: %v", err))
			}
		case Provisioning:
			m.startProvisioningLocked(e)
		}
	}
	m.sweepLocked()
	if err := m.saveLocked(); err != nil {
		return nil, err
	}
	return m, nil
}

func (m *Manager) runDir(id string) string { return filepath.Join(m.cfg.Dir, "runs", id) }

// Workspace is the checkout a run's commands run in.
func (m *Manager) Workspace(id string) string { return filepath.Join(m.runDir(id), "workspace") }

// LogFile is the run's log.
func (m *Manager) LogFile(id string) string { return filepath.Join(m.runDir(id), "run.log") }

// CreateRequest is a create-run call.
type CreateRequest struct {
	Definition     rwxapi.RunDefinition
	IdempotencyKey string
}

var validID = regexp.MustCompile(`^[0-9a-f]{32}$`)

// ValidID reports whether id has the form of a run id (anything else can
// never name a run, nor a directory).
func ValidID(id string) bool { return validID.MatchString(id) }

// Create registers a run and starts provisioning it. With an idempotency
// key whose run is still active it returns that run and existing=true.
func (m *Manager) Create(req CreateRequest) (run Run, existing bool, err error) {
	def := req.Definition
	cfgEntry, err := validate(def, req.IdempotencyKey)
	if err != nil {
		return Run{}, false, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return Run{}, false, ErrClosed
	}
	if req.IdempotencyKey != "" {
		if id, ok := m.byKey[req.IdempotencyKey]; ok {
			if e := m.runs[id]; e != nil && e.State != Completed {
				return e.Run, true, nil
			}
		}
	}
	now := m.cfg.Clock.Now().UTC()
	r := Run{
		Title:          def.Title,
		CLIState:       def.CLIState,
		IdempotencyKey: req.IdempotencyKey,
		Git:            def.Git,
		ConfigPath:     cfgEntry.Path,
		Config:         cfgEntry.FileContents,
		InitParams:     def.InitializationParameters,
		State:          Provisioning,
		CreatedAt:      now,
		ExpiresAt:      now.Add(m.cfg.MaxLifetime),
		IdleTimeout:    m.cfg.IdleTimeout,
	}
	if r.ID, err = m.randomHex(16); err != nil {
		return Run{}, false, err
	}
	if r.HostKeySeed, err = m.randomBytes(32); err != nil {
		return Run{}, false, err
	}
	if r.UserKeySeed, err = m.randomBytes(32); err != nil {
		return Run{}, false, err
	}
	if r.Title == "" {
		r.Title = fmt.Sprintf("Sandbox: %s (%s)", strings.TrimSuffix(filepath.Base(def.Git.OriginURL), ".git"), def.Git.Branch)
	}
	if err := m.writeMintDirectory(r.ID, def.MintDirectory); err != nil {
		os.RemoveAll(m.runDir(r.ID))
		return Run{}, false, err
	}
	e := &entry{Run: r}
	m.runs[r.ID] = e
	if r.IdempotencyKey != "" {
		m.byKey[r.IdempotencyKey] = r.ID
	}
	if err := m.saveLocked(); err != nil {
		delete(m.runs, r.ID)
		delete(m.byKey, r.IdempotencyKey)
		os.RemoveAll(m.runDir(r.ID))
		return Run{}, false, err
	}
	m.startProvisioningLocked(e)
	m.log.Info("run created", "run", r.ID, "origin", r.Git.OriginURL, "sha", r.Git.Sha)
	return e.Run, false, nil
}

// validate checks a definition and returns its config file entry.
func validate(def rwxapi.RunDefinition, key string) (rwxapi.DirectoryEntry, error) {
	bad := func(format string, a ...any) (rwxapi.DirectoryEntry, error) {
		return rwxapi.DirectoryEntry{}, fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, a...))
	}
	if len(key) > 255 {
		return bad("the Idempotency-Key header is longer than 255 characters")
	}
	origin := strings.TrimSpace(def.Git.OriginURL)
	if origin == "" {
		return bad("git.origin_url is missing: localcloud clones the sandbox's repository from it; give the repository an origin remote (git remote add origin <url or path>)")
	}
	if strings.HasPrefix(origin, "-") || strings.ContainsAny(origin, "\x00\n") {
		return bad("git.origin_url %q is not a repository location", origin)
	}
	if !strings.Contains(origin, "://") && !filepath.IsAbs(origin) && !scpLike.MatchString(origin) {
		return bad("git.origin_url %q is a relative path: localcloud can clone absolute paths and URLs only", origin)
	}
	if !provision.ValidSha(def.Git.Sha) {
		return bad("git.sha %q is not a commit id", def.Git.Sha)
	}
	for _, e := range append(append([]rwxapi.DirectoryEntry{}, def.TaskDefinitions...), def.MintDirectory...) {
		if err := checkEntry(e); err != nil {
			return rwxapi.DirectoryEntry{}, err
		}
	}
	var cfg *rwxapi.DirectoryEntry
	for i, e := range def.TaskDefinitions {
		if e.Type == "file" || e.Type == "" {
			cfg = &def.TaskDefinitions[i]
			break
		}
	}
	if cfg == nil {
		return bad("task_definitions holds no file: send the sandbox config (for example .rwx/sandbox.yml)")
	}
	if _, err := provision.ParseConfig([]byte(cfg.FileContents)); err != nil {
		return bad("%s: %v", cfg.Path, err)
	}
	return *cfg, nil
}

// scpLike matches git's user@host:path form.
var scpLike = regexp.MustCompile(`^[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:`)

func checkEntry(e rwxapi.DirectoryEntry) error {
	if e.Type != "file" && e.Type != "dir" && e.Type != "" {
		return fmt.Errorf("%w: entry %q has type %q: use \"file\" or \"dir\"", ErrInvalid, e.Path, e.Type)
	}
	p := e.Path
	if p == "" || strings.ContainsRune(p, 0) || filepath.IsAbs(p) {
		return fmt.Errorf("%w: entry path %q must be a relative path", ErrInvalid, p)
	}
	if c := filepath.Clean(p); c == ".." || strings.HasPrefix(c, "../") {
		return fmt.Errorf("%w: entry path %q points outside the run's directory", ErrInvalid, p)
	}
	return nil
}

// writeMintDirectory materializes the .rwx directory sent with the run
// under the run's directory (not in the workspace, which stays a clean
// checkout).
func (m *Manager) writeMintDirectory(id string, entries []rwxapi.DirectoryEntry) error {
	base := filepath.Join(m.runDir(id), "rwx")
	if err := os.MkdirAll(base, 0o700); err != nil {
		return fmt.Errorf("create the run directory: %w", err)
	}
	for _, e := range entries {
		p := filepath.Join(base, filepath.Clean(e.Path))
		if e.Type == "dir" {
			if err := os.MkdirAll(p, 0o700); err != nil {
				return fmt.Errorf("write the run's .rwx directory: %w", err)
			}
			continue
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			return fmt.Errorf("write the run's .rwx directory: %w", err)
		}
		mode := fs.FileMode(e.Permissions) & 0o777
		if mode == 0 {
			mode = 0o644
		}
		if err := os.WriteFile(p, []byte(e.FileContents), mode); err != nil {
			return fmt.Errorf("write the run's .rwx directory: %w", err)
		}
	}
	return nil
}

func (m *Manager) startProvisioningLocked(e *entry) {
	ctx, cancel := context.WithCancelCause(context.Background())
	e.cancel = cancel
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		m.provision(ctx, e.ID)
	}()
}

// provision clones the repository and runs the setup steps, then starts
// the agent. It holds no lock while the slow work runs.
func (m *Manager) provision(ctx context.Context, id string) {
	m.mu.Lock()
	e := m.runs[id]
	r := e.Run
	m.mu.Unlock()
	start := time.Now()
	dir := m.runDir(id)
	ws := filepath.Join(dir, "workspace")
	home := filepath.Join(dir, "home")
	logf, err := m.openLog(id)
	if err == nil {
		// A restart re-provisions from scratch.
		err = os.RemoveAll(ws)
	}
	if err == nil {
		err = os.MkdirAll(home, 0o700)
	}
	if err == nil {
		m.setStep(e, "cloning the repository")
		fmt.Fprintf(logf, "==> provisioning run %s: %s at %s\n", id, r.Git.OriginURL, r.Git.Sha)
		err = provision.Clone(ctx, provision.CloneOptions{Origin: r.Git.OriginURL, Sha: r.Git.Sha, Branch: r.Git.Branch, Dest: ws, Env: m.cfg.GitEnv, Log: logf})
	}
	var newCmd provision.Commander
	if err == nil {
		var sb *sandbox.Sandbox
		m.mu.Lock()
		if e.State == Provisioning {
			sb, err = m.sandboxLocked(ctx, e)
		}
		m.mu.Unlock()
		if sb != nil {
			newCmd = sb.Command
		}
	}
	if err == nil {
		var def provision.Definition
		def, err = provision.ParseConfig([]byte(r.Config))
		// One step at a time, so that connection info can say which runs.
		for i, step := range def.Steps {
			if err != nil {
				break
			}
			m.setStep(e, fmt.Sprintf("setup step %s (%d/%d)", step.Key, i+1, len(def.Steps)))
			err = provision.RunStepsIn(ctx, newCmd, []provision.Step{step}, ws, m.sandboxEnv(id, ws, home), logf)
		}
		if err == nil {
			m.setStep(e, "starting the sandbox agent")
		}
	}

	m.mu.Lock()
	defer m.mu.Unlock()
	if e.State != Provisioning {
		return // cancelled or timed out meanwhile
	}
	if ctx.Err() != nil {
		if errors.Is(context.Cause(ctx), errShutdown) {
			return // resumes after the restart
		}
		m.completeLocked(e, ReasonCancelled, "cancelled while provisioning")
		m.saveQuietLocked()
		return
	}
	if err != nil {
		fmt.Fprintf(logf, "==> provisioning failed: %v\n", err)
		var se *provision.StepError
		if errors.As(err, &se) {
			e.FailedTask, e.FailedOutput = se.Key, se.Output
		}
		m.completeLocked(e, ReasonFailed, err.Error())
		m.saveQuietLocked()
		return
	}
	now := m.cfg.Clock.Now().UTC()
	e.SandboxableAt, e.LastActivityAt = now, now
	if err := m.startAgentLocked(e); err != nil {
		m.completeLocked(e, ReasonFailed, fmt.Sprintf("start the sandbox agent: %v", err))
		m.saveQuietLocked()
		return
	}
	e.State = Sandboxable
	fmt.Fprintf(logf, "==> sandboxable after %s: agent on %s\n", time.Since(start).Round(time.Millisecond), e.AgentAddr)
	m.log.Info("run sandboxable", "run", id, "agent", e.AgentAddr, "took", time.Since(start).Round(time.Millisecond))
	m.saveQuietLocked()
}

func (m *Manager) openLog(id string) (*os.File, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.runs[id]
	if e.logFile != nil {
		return e.logFile, nil
	}
	if err := os.MkdirAll(m.runDir(id), 0o700); err != nil {
		return nil, fmt.Errorf("create the run directory: %w", err)
	}
	f, err := os.OpenFile(m.LogFile(id), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open the run log: %w", err)
	}
	e.logFile = f
	return f, nil
}

// startAgentLocked starts the run's agent on its previous address when it
// had one and it is free, else on a new port.
func (m *Manager) startAgentLocked(e *entry) error {
	host, err := e.hostSigner()
	if err != nil {
		return err
	}
	userKey, err := e.userPublicKey()
	if err != nil {
		return err
	}
	ws := filepath.Join(m.runDir(e.ID), "workspace")
	home := filepath.Join(m.runDir(e.ID), "home")
	if err := os.MkdirAll(home, 0o700); err != nil {
		return fmt.Errorf("create the sandbox home: %w", err)
	}
	var runLog io.Writer
	if e.logFile == nil {
		if f, err := os.OpenFile(m.LogFile(e.ID), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600); err == nil {
			e.logFile = f
		}
	}
	if e.logFile != nil {
		runLog = e.logFile
	}
	id := e.ID
	sb, err := m.sandboxLocked(context.Background(), e)
	if err != nil {
		return err
	}
	// The config was checked when the run was created.
	def, err := provision.ParseConfig([]byte(e.Config))
	if err != nil {
		return err
	}
	cfg := agent.Config{
		HostKey:       host,
		AuthorizedKey: userKey,
		Workspace:     ws,
		Env:           provision.WithEnv(m.sandboxEnv(id, ws, home), def.Env),
		RunLog:        runLog,
		Logger:        m.log.With("run", id),
		ProcessDir:    m.processDir(id),
		OnEnd:         func() { m.end(id) },
		OnActivity:    func() { m.touch(id) },
		Refuse:        m.cfg.RefuseSSH,
		WrapListener:  m.cfg.WrapListener,

		KeepaliveInterval: m.cfg.AgentKeepaliveInterval,
		KeepaliveCount:    m.cfg.AgentKeepaliveCount,
	}
	if sb != nil {
		cfg.Sandbox = sb
	}
	var a *agent.Agent
	if e.AgentAddr != "" {
		// Keep the address clients know, if it is still free.
		cfg.Addr = e.AgentAddr
		if a, err = agent.Start(cfg); err != nil {
			m.log.Info("the agent's previous address is not available; using a new one", "run", id, "addr", e.AgentAddr, "err", err)
		}
	}
	if a == nil {
		cfg.Addr = m.cfg.AgentHost + ":0"
		if a, err = agent.Start(cfg); err != nil {
			return err
		}
	}
	e.agent = a
	e.AgentAddr = a.Addr()
	e.connInfo, err = connectionInfo(e.Run)
	return err
}

func connectionInfo(r Run) (rwxapi.ConnectionInfo, error) {
	hostKey, err := r.publicHostKey()
	if err != nil {
		return rwxapi.ConnectionInfo{}, err
	}
	userKey, err := r.privateUserKeyPEM()
	if err != nil {
		return rwxapi.ConnectionInfo{}, err
	}
	return rwxapi.ConnectionInfo{Sandboxable: true, Address: r.AgentAddr, PublicHostKey: hostKey, PrivateUserKey: userKey}, nil
}

// completeLocked ends a run; the agent is stopped in the background so
// that the caller (possibly a session of that agent) never waits on it.
func (m *Manager) completeLocked(e *entry, reason Reason, detail string) {
	if e.State == Completed {
		return
	}
	e.State, e.Reason, e.Detail = Completed, reason, detail
	e.CompletedAt = m.cfg.Clock.Now().UTC()
	if e.IdempotencyKey != "" && m.byKey[e.IdempotencyKey] == e.ID {
		delete(m.byKey, e.IdempotencyKey)
	}
	if e.cancel != nil {
		e.cancel(errors.New(string(reason)))
	}
	a, logf, sb := e.agent, e.logFile, e.nook
	e.agent, e.logFile, e.nook = nil, nil, nil
	if logf != nil {
		fmt.Fprintf(logf, "==> run completed (%s)\n", e.Ended())
	}
	m.log.Info("run completed", "run", e.ID, "reason", reason, "detail", detail)
	ws, logs := filepath.Join(m.runDir(e.ID), "workspace"), m.processDir(e.ID)
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		if a != nil {
			a.Close()
		}
		if sb != nil {
			sb.Close() // everything the run started ends with it
		}
		if logf != nil {
			logf.Close()
		}
		// The checkout and the processes' logs go with the run (the run
		// log stays).
		_ = os.RemoveAll(ws)
		_ = os.RemoveAll(logs)
	}()
}

// Get returns run id.
func (m *Manager) Get(id string) (Run, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.runs[id]
	if !ok {
		return Run{}, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	return e.Run, nil
}

// setStep records what provisioning of e is doing now.
func (m *Manager) setStep(e *entry, step string) {
	m.mu.Lock()
	e.step = step
	m.mu.Unlock()
}

// ConnectionInfo answers sandbox_connection_info: not yet sandboxable
// (with a polling hint), sandboxable (address and keys), or ErrGone.
func (m *Manager) ConnectionInfo(id string) (rwxapi.ConnectionInfo, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.runs[id]
	if !ok {
		return rwxapi.ConnectionInfo{}, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	switch e.State {
	case Provisioning:
		return rwxapi.ConnectionInfo{Polling: rwxapi.Polling{BackoffMs: 250}, Status: e.step}, nil
	case Sandboxable:
		ci := e.connInfo
		ci.ExpiresAt = e.Deadline().UTC().Format(time.RFC3339)
		return ci, nil
	default:
		if e.SandboxableAt.IsZero() {
			// Over before it was ever sandboxable (a setup step failed,
			// cancelled or timed out while provisioning): the RWX answer
			// is 200, completed, with the reason; results/prompt says more.
			return rwxapi.ConnectionInfo{Polling: rwxapi.Polling{Completed: true}, FailureReason: string(e.Reason)}, nil
		}
		return rwxapi.ConnectionInfo{}, fmt.Errorf("%w: run %s %s", ErrGone, id, e.Ended())
	}
}

// Cancel ends a run that is provisioning or sandboxable; cancelling a
// completed run changes nothing (stop is idempotent).
func (m *Manager) Cancel(id string) (Run, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.runs[id]
	if !ok {
		return Run{}, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	if e.State != Completed {
		m.completeLocked(e, ReasonCancelled, "cancelled through the API")
		m.saveQuietLocked()
	}
	return e.Run, nil
}

// end completes a run whose client sent __rwx_sandbox_end__.
func (m *Manager) end(id string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if e, ok := m.runs[id]; ok && e.State != Completed {
		m.completeLocked(e, ReasonEnded, "ended by the client")
		m.saveQuietLocked()
	}
}

func (m *Manager) touch(id string) {
	now := m.cfg.Clock.Now().UTC()
	m.mu.Lock()
	defer m.mu.Unlock()
	if e, ok := m.runs[id]; ok && now.After(e.LastActivityAt) {
		e.LastActivityAt = now
		m.dirty = true
	}
}

// Filter selects runs for List; empty fields match everything.
type Filter struct {
	States  []State
	Reasons []Reason
}

// List returns the matching runs, oldest first.
func (m *Manager) List(f Filter) []Run {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []Run
	for _, e := range m.runs {
		if len(f.States) > 0 && !contains(f.States, e.State) {
			continue
		}
		if len(f.Reasons) > 0 && !contains(f.Reasons, e.Reason) {
			continue
		}
		out = append(out, e.Run)
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].CreatedAt.Equal(out[j].CreatedAt) {
			return out[i].CreatedAt.Before(out[j].CreatedAt)
		}
		return out[i].ID < out[j].ID
	})
	return out
}

func contains[T comparable](xs []T, x T) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

// IssueToken creates a token scoped to run id.
func (m *Manager) IssueToken(id string, ttl time.Duration) (string, time.Time, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.runs[id]
	if !ok {
		return "", time.Time{}, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	raw, err := m.randomHex(32)
	if err != nil {
		return "", time.Time{}, err
	}
	token := "lcs_" + raw
	exp := m.cfg.Clock.Now().UTC().Add(ttl)
	h := hashToken(token)
	e.Tokens = append(e.Tokens, TokenRecord{Hash: h, ExpiresAt: exp})
	m.byToken[h] = id
	if err := m.saveLocked(); err != nil {
		return "", time.Time{}, err
	}
	return token, exp, nil
}

// TokenRun returns the run a scoped token belongs to, if the token is known
// and not expired.
func (m *Manager) TokenRun(token string) (string, bool) {
	h := hashToken(token)
	m.mu.Lock()
	defer m.mu.Unlock()
	id, ok := m.byToken[h]
	if !ok {
		return "", false
	}
	now := m.cfg.Clock.Now()
	for _, t := range m.runs[id].Tokens {
		if subtle.ConstantTimeCompare([]byte(t.Hash), []byte(h)) == 1 && now.Before(t.ExpiresAt) {
			return id, true
		}
	}
	return "", false
}

func hashToken(t string) string {
	s := sha256.Sum256([]byte(t))
	return hex.EncodeToString(s[:])
}

// SSHStats returns the counters of run id's agent connections.
func (m *Manager) SSHStats(id string) (agent.Stats, error) {
	m.mu.Lock()
	e, ok := m.runs[id]
	var a *agent.Agent
	if ok {
		a = e.agent
	}
	m.mu.Unlock()
	if !ok {
		return agent.Stats{}, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	if a == nil {
		return agent.Stats{}, fmt.Errorf("%w: run %s has no sandbox agent (%s)", ErrGone, id, e.State)
	}
	return a.Stats(), nil
}

// DropConnections closes every SSH connection to run id's agent.
func (m *Manager) DropConnections(id string) (int, error) {
	m.mu.Lock()
	e, ok := m.runs[id]
	var a *agent.Agent
	if ok {
		a = e.agent
	}
	m.mu.Unlock()
	if !ok {
		return 0, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	if a == nil {
		return 0, fmt.Errorf("%w: run %s has no sandbox agent (%s)", ErrGone, id, e.State)
	}
	return a.DropConnections(), nil
}

// Sweep ends runs past their deadlines and persists recent activity. The
// lifetime deadline applies to every live run; the idle deadline only to
// sandboxable runs with nothing running.
func (m *Manager) Sweep() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return
	}
	if m.sweepLocked() || m.dirty {
		m.saveQuietLocked()
	}
}

func (m *Manager) sweepLocked() (changed bool) {
	now := m.cfg.Clock.Now()
	for _, e := range m.runs {
		switch {
		case e.State == Completed:
		case !now.Before(e.ExpiresAt):
			m.completeLocked(e, ReasonTimedOut, fmt.Sprintf("reached its maximum lifetime (it ended at %s)", e.ExpiresAt.Format(time.RFC3339)))
			changed = true
		case e.State == Sandboxable && !now.Before(e.IdleDeadline()) && (e.agent == nil || !e.agent.Busy()):
			m.completeLocked(e, ReasonTimedOut, fmt.Sprintf("idle for %s", e.IdleTimeout))
			changed = true
		}
	}
	return changed
}

// Close stops every agent and interrupts provisioning, keeping the state:
// sandboxable and provisioning runs come back on the next Open.
func (m *Manager) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	var agents []*agent.Agent
	var sandboxes []*sandbox.Sandbox
	for _, e := range m.runs {
		if e.cancel != nil {
			e.cancel(errShutdown)
		}
		if e.agent != nil {
			agents = append(agents, e.agent)
			e.agent = nil
		}
		if e.nook != nil {
			sandboxes = append(sandboxes, e.nook)
			e.nook = nil
		}
	}
	m.mu.Unlock()
	for _, a := range agents {
		a.Close()
	}
	for _, sb := range sandboxes {
		sb.Close()
	}
	m.wg.Wait()
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, e := range m.runs {
		if e.logFile != nil {
			e.logFile.Close()
			e.logFile = nil
		}
	}
	return m.saveLocked()
}

func (m *Manager) saveQuietLocked() {
	if err := m.saveLocked(); err != nil {
		m.log.Error("persist the run registry", "err", err)
	}
}

func (m *Manager) saveLocked() error {
	sf := stateFile{Version: 1, Runs: make([]Run, 0, len(m.runs))}
	for _, e := range m.runs {
		sf.Runs = append(sf.Runs, e.Run)
	}
	sort.Slice(sf.Runs, func(i, j int) bool { return sf.Runs[i].ID < sf.Runs[j].ID })
	b, err := json.MarshalIndent(sf, "", "  ")
	if err != nil {
		return fmt.Errorf("encode the run registry: %w", err)
	}
	if err := WriteFileAtomic(filepath.Join(m.cfg.Dir, StateFile), b, 0o600); err != nil {
		return fmt.Errorf("persist the run registry: %w", err)
	}
	m.dirty = false
	return nil
}

// WriteFileAtomic writes through a temporary file, fsync and rename, so
// that readers and crashes see the old or the new content, never a part.
func WriteFileAtomic(path string, data []byte, perm fs.FileMode) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp) // no-op after the rename
	if err := f.Chmod(perm); err != nil {
		f.Close()
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return nil
}

func (m *Manager) randomBytes(n int) ([]byte, error) {
	b := make([]byte, n)
	if _, err := io.ReadFull(m.cfg.Random, b); err != nil {
		return nil, fmt.Errorf("read random bytes: %w", err)
	}
	return b, nil
}

func (m *Manager) randomHex(n int) (string, error) {
	b, err := m.randomBytes(n)
	if err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}

// sandboxEnv is the environment of sandbox commands and setup steps before
// their config's `env:` (documented in docs/localcloud.md).
func (m *Manager) sandboxEnv(runID, workspace, home string) []string {
	name := "sandbox"
	if u, err := user.Current(); err == nil {
		name = u.Username
	}
	return []string{
		"PATH=" + sandbox.ToolchainPath(m.cfg.Toolchains),
		"HOME=" + home,
		"LANG=C.UTF-8",
		"USER=" + name,
		"LOGNAME=" + name,
		"SHELL=/bin/sh",
		"RWX_SANDBOX=1",
		"RWX_RUN_ID=" + runID,
		"RWX_WORKSPACE=" + workspace,
	}
}

// processDir holds the logs of run id's managed background processes: the
// run's, outside its workspace (the sandbox sees it read-only).
func (m *Manager) processDir(id string) string {
	return filepath.Join(m.runDir(id), "processes")
}

// sandboxLocked returns run e's sandbox, starting it (and its watch) if
// needed; nil without isolation.
func (m *Manager) sandboxLocked(ctx context.Context, e *entry) (*sandbox.Sandbox, error) {
	if m.cfg.Sandboxes == nil {
		return nil, nil
	}
	if e.nook != nil {
		return e.nook, nil
	}
	logs := m.processDir(e.ID)
	if err := os.MkdirAll(logs, 0o755); err != nil {
		return nil, fmt.Errorf("create the run's process log directory: %w", err)
	}
	sb, err := m.cfg.Sandboxes.Start(ctx, sandbox.Spec{ID: e.ID, Workspace: filepath.Join(m.runDir(e.ID), "workspace"), Home: filepath.Join(m.runDir(e.ID), "home"), Logs: logs, Logger: m.log.With("run", e.ID)})
	if err != nil {
		return nil, fmt.Errorf("start the run's sandbox: %w", err)
	}
	e.nook = sb
	m.wg.Add(1)
	go m.watchSandbox(e.ID, sb)
	return sb, nil
}

// watchSandbox ends the run when its sandbox goes over its memory or disk
// limit, or dies under it.
func (m *Manager) watchSandbox(id string, sb *sandbox.Sandbox) {
	defer m.wg.Done()
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	// The disk is measured less often: it walks the run's files (and
	// never takes more than a twentieth of the time).
	disk := time.NewTimer(sb.DiskCheckEvery())
	defer disk.Stop()
	fail := func(detail string) {
		m.mu.Lock()
		if e := m.runs[id]; e != nil && e.nook == sb && e.State != Completed {
			m.completeLocked(e, ReasonFailed, detail)
			m.saveQuietLocked()
		}
		m.mu.Unlock()
	}
	for {
		select {
		case <-sb.Done():
			fail("the run's sandbox ended unexpectedly")
			return
		case <-t.C:
			if sb.OOMKilled() {
				fail("memory limit: a process of the run was killed for going over the run's memory limit")
				return
			}
		case <-disk.C:
			start := time.Now()
			used, limit, over := sb.OverDiskLimit()
			if over {
				fail(fmt.Sprintf("disk limit: the run's files take %d bytes, over the run's limit of %d (sandboxd-localcloud serve --disk-limit)", used, limit))
				return
			}
			disk.Reset(max(sb.DiskCheckEvery(), 20*time.Since(start)))
		}
	}
}

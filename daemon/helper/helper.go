// Package helper installs sandboxd-helper (package sandboxhelper) in the
// sandboxes and keeps its server running, so that the sync scripts stage
// only what changed. The server is one of the sandbox agent's managed
// processes (the directives RWX's CLI uses for `rwx sandbox background`,
// under the name helperproto.ProcessKey): it outlives the connection that
// started it, a new connection finds it again (ping), and the session's
// end stops it. The helper never stands in the way: until it serves, and
// wherever it cannot (another platform, an agent without managed
// processes, no binary, a start that failed), the scripts stage the whole
// tree as they always did, and the reason is said once (OnFallback, and
// Status for doctor).
package helper

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/daemon/gitsync"
	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// Conn is the connection the helper is started over (*sshpool.Conn).
type Conn interface {
	ExecOnce(ctx context.Context, command string, stdio sshpool.Stdio) (sshpool.ExitStatus, error)
	Done() <-chan struct{}
}

// runIDer is a Conn that knows its run (*sshpool.Conn): a fallback is said
// once per run, not once per connection.
type runIDer interface{ RunID() string }

// Options configure a Manager.
type Options struct {
	// Binary is the helper built for Platform; "" (or a file that cannot
	// be read) turns the helper off.
	Binary string
	// Platform is Binary's platform as `uname -sm` prints it in the
	// sandbox ("Linux x86_64"); sandboxes of another platform go without.
	Platform string
	Logger   *slog.Logger
	// RetryAfter is how long a connection whose helper failed goes
	// without before the next try (default a minute); it doubles with
	// each failure on the connection, up to an hour. A sandbox of another
	// platform, or whose agent runs no managed processes, is never tried
	// again on the connection.
	RetryAfter time.Duration
	// RecheckAfter is how long an answering server is believed before
	// the next use asks it again, in the background (default 10 minutes,
	// well under the server's idle exit): a server that was killed is
	// started again.
	RecheckAfter time.Duration
	// OnFallback, optional, is told once per run why synced execs go
	// without the helper there.
	OnFallback func(runID, reason string)
	Now        func() time.Time
}

// Manager keeps the helper's server running for each connection's sandbox.
type Manager struct {
	o    Options
	log  *slog.Logger
	ctx  context.Context
	stop context.CancelFunc

	mu  sync.Mutex
	bin *binFile // nil: the helper is off
	// conns holds the state of each sandbox, by run (keyOf): the server
	// outlives connections, so a new connection finds it known.
	conns map[any]*state
	said  map[string]bool // runs whose fallback was said
	wg    sync.WaitGroup
}

// binFile is one helper binary, named by its hash on first use.
type binFile struct {
	path string
	load sync.Once
	sum  string // the binary's SHA-256
	name string // its installed name: sandboxd-helper-<sum prefix>
}

type state struct {
	conn     Conn      // the connection it was last asked on
	bin      *binFile  // the binary this sandbox's server runs
	instance string    // set once the server answers
	verified time.Time // when it last answered
	failed   time.Time // the last try failed at this time
	wait     time.Duration
	never    bool   // the sandbox cannot run this helper
	running  bool   // a start or a recheck is under way
	reason   string // why it does not serve, when it does not
}

// New returns a Manager; nothing runs until For is called.
func New(o Options) *Manager {
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.RetryAfter <= 0 {
		o.RetryAfter = time.Minute
	}
	if o.RecheckAfter <= 0 {
		o.RecheckAfter = 10 * time.Minute
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	ctx, stop := context.WithCancel(context.Background())
	m := &Manager{o: o, log: o.Logger, ctx: ctx, stop: stop, conns: map[any]*state{}, said: map[string]bool{}}
	if o.Binary != "" {
		m.bin = &binFile{path: o.Binary}
	}
	return m
}

// SetBinary switches the helper to another binary, or off with "" (a
// reloaded configuration). The servers of the previous one are stopped;
// each connection starts the new one on its next use.
func (m *Manager) SetBinary(path string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if (m.bin == nil && path == "") || (m.bin != nil && m.bin.path == path) {
		return
	}
	m.bin = nil
	if path != "" {
		m.bin = &binFile{path: path}
	}
	for _, st := range m.conns {
		if st.instance != "" && path == "" {
			m.wg.Add(1)
			go func() {
				defer m.wg.Done()
				m.stopServer(m.ctx, st.conn)
			}()
		}
	}
	m.conns = map[any]*state{}
	m.said = map[string]bool{}
	m.log.Info("sandbox helper changed", "binary", path)
}

// For returns the installed helper's file name (under the sandbox's
// .git/sandboxd/bin) and its server's instance once the server answers in
// c's sandbox; until then "" and "", having started it in the background.
func (m *Manager) For(c Conn) (name, instance string) {
	if m == nil {
		return "", ""
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.bin == nil || m.ctx.Err() != nil {
		return "", ""
	}
	m.forgetEnded()
	st := m.conns[keyOf(c)]
	switch {
	case st == nil:
		st = &state{conn: c, bin: m.bin}
		m.conns[keyOf(c)] = st
	case st.instance != "":
		if !st.running && m.o.Now().Sub(st.verified) >= m.o.RecheckAfter {
			// Still offered meanwhile: a server that is gone makes the
			// scripts stage the whole tree, nothing worse.
			m.start(c, st)
		}
		return st.bin.name, st.instance
	case st.running || st.never || m.o.Now().Sub(st.failed) < st.wait:
		return "", ""
	}
	m.start(c, st)
	return "", ""
}

// keyOf is the key of c's sandbox: its run, or c itself when it does not
// say.
func keyOf(c Conn) any {
	if r, ok := c.(runIDer); ok {
		return r.RunID()
	}
	return c
}

// forgetEnded drops the states kept by a connection that ended (m.mu
// held); a run's state stays for its next connection.
func (m *Manager) forgetEnded() {
	for k, st := range m.conns {
		if _, byConn := k.(Conn); !byConn {
			continue
		}
		select {
		case <-st.conn.Done():
			delete(m.conns, k)
		default:
		}
	}
}

// start runs ensure on c in the background (m.mu held).
func (m *Manager) start(c Conn, st *state) {
	st.running, st.conn = true, c
	m.wg.Add(1)
	go m.run(c, st)
}

// Unavailable reports that the helper will not serve on c soon: it is off,
// the sandbox cannot run it, or its last try failed and the next waits
// for its retry time. A caller that needs the helper stops waiting then.
func (m *Manager) Unavailable(c Conn) bool {
	if m == nil {
		return true
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.bin == nil || m.ctx.Err() != nil {
		return true
	}
	st := m.conns[keyOf(c)]
	if st == nil || st.running || st.instance != "" {
		return false
	}
	return st.never || m.o.Now().Sub(st.failed) < st.wait
}

// Status says whether the helper serves in c's sandbox, and if not why
// (for doctor). ok is false only for a failure worth a look; the helper
// being off or of another platform is said with ok true.
func (m *Manager) Status(c Conn) (ok bool, detail string) {
	if m == nil {
		return true, "off: synced execs scan the sandbox's whole tree"
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.bin == nil {
		return true, "off (sync_helper, or no sandboxd-helper next to sandboxd): synced execs scan the sandbox's whole tree"
	}
	st := m.conns[keyOf(c)]
	switch {
	case st == nil:
		return true, "not started yet: the first synced exec starts it"
	case st.instance != "":
		return true, fmt.Sprintf("serving (managed process %q, instance %s)", helperproto.ProcessKey, st.instance)
	case st.running && st.reason == "":
		return true, "starting"
	case st.never:
		return true, "not used here: " + st.reason
	}
	return false, "not running: " + st.reason + "; synced execs scan the sandbox's whole tree meanwhile"
}

// Close stops the starts under way and waits. The servers go on in their
// sandboxes (a daemon that restarts finds them); Stop ends one.
func (m *Manager) Close() {
	m.stop()
	m.wg.Wait()
}

// Stop stops the server in c's sandbox (the session ends), whether this
// daemon or an earlier one started it; bounded, and without effect where
// none runs.
func (m *Manager) Stop(ctx context.Context, c Conn) {
	if m == nil {
		return
	}
	m.mu.Lock()
	off := m.bin == nil
	delete(m.conns, keyOf(c))
	m.mu.Unlock()
	if off {
		return
	}
	m.stopServer(ctx, c)
}

func (m *Manager) stopServer(ctx context.Context, c Conn) {
	ctx, cancel := context.WithTimeout(ctx, stopTimeout)
	defer cancel()
	if _, err := m.directive(ctx, c, directiveStop, map[string]any{"key": helperproto.ProcessKey}); err != nil {
		m.log.Debug("stop the sandbox helper", "err", err)
	}
}

// run starts the server on c, or finds it, or asks it again.
func (m *Manager) run(c Conn, st *state) {
	defer m.wg.Done()
	ctx, cancel := context.WithCancel(m.ctx)
	defer cancel()
	go func() {
		select {
		case <-c.Done():
			cancel()
		case <-ctx.Done():
		}
	}()
	inst, err := m.ensure(ctx, c, st)
	m.mu.Lock()
	defer m.mu.Unlock()
	st.running = false
	if m.conns[keyOf(c)] != st {
		return // the binary changed, or the session ended
	}
	if err == nil {
		if st.instance != "" && st.instance != inst {
			m.log.Info("sandbox helper started again", "was", st.instance, "instance", inst)
		}
		st.instance, st.verified, st.wait, st.reason = inst, m.o.Now(), 0, ""
		return
	}
	if ctx.Err() != nil || errors.Is(err, sshpool.ErrConnectionLost) || errors.Is(err, sshpool.ErrNotSent) {
		// The connection ended (perhaps before Done says so): no fault of
		// the helper's, and the next connection tries again at once.
		return
	}
	st.instance = ""
	st.failed = m.o.Now()
	st.wait = min(max(2*st.wait, m.o.RetryAfter), time.Hour)
	st.never = errors.Is(err, errPlatform) || errors.Is(err, errNoProcesses)
	st.reason = err.Error()
	// Another platform is expected and logged at debug level; anything
	// else is worth a look (a sandbox that cannot run it, a broken
	// upload) and costs speed, not results.
	level := slog.LevelWarn
	if st.never {
		level = slog.LevelDebug
	}
	m.log.Log(context.Background(), level, "sandbox helper not running: synced execs scan the sandbox's whole tree", "retry_in", st.wait, "err", err)
	if r, ok := c.(runIDer); ok && m.o.OnFallback != nil && !m.said[r.RunID()] {
		m.said[r.RunID()] = true
		m.o.OnFallback(r.RunID(), err.Error())
	}
}

// loadBinary names b by its hash, once. The binary itself is read again
// for each upload rather than held (it is megabytes, uploads are rare).
func (m *Manager) loadBinary(b *binFile) error {
	b.load.Do(func() {
		data, err := os.ReadFile(b.path)
		if err != nil {
			m.log.Debug("sandbox helper unavailable", "binary", b.path, "err", err)
			return
		}
		b.sum = hashOf(data)
		b.name = helperproto.Name + "-" + b.sum[:16]
	})
	if b.sum == "" {
		return fmt.Errorf("no helper binary at %s", b.path)
	}
	return nil
}

func hashOf(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// errPlatform: the sandbox is not of the helper's platform.
var errPlatform = errors.New("another platform")

// errNoProcesses: the sandbox's agent runs no managed processes.
var errNoProcesses = errors.New("the sandbox's agent does not run managed processes (exit 127 to " + directiveStart + ")")

// Deadlines of the helper's steps in a sandbox, which may never answer:
// each failure is tried again later, the scripts meanwhile stage the
// whole tree.
const (
	probeTimeout     = 30 * time.Second
	installTimeout   = 2 * time.Minute
	readyTimeout     = 30 * time.Second
	directiveTimeout = 30 * time.Second
	stopTimeout      = 10 * time.Second
)

// Exit codes of the probe.
const (
	probeMissing = 3 // not installed (or damaged): its platform follows
)

// Managed-process directives of the sandbox agent (RWX CLI `sandbox
// background`): the directive, a space, a JSON request; one JSON process
// record on stdout; exit 127 where the agent has none.
const (
	directiveStart = "__rwx_sandbox_process_start__"
	directiveStop  = "__rwx_sandbox_process_stop__"
)

// ensure returns the instance of the server in c's sandbox: the one that
// answers (ping), else one it starts, installing the binary first when it
// is missing. Three round trips at most when all is there but the server
// (probe, start, ping), one when the server answers.
func (m *Manager) ensure(ctx context.Context, c Conn, st *state) (string, error) {
	b := st.bin
	if err := m.loadBinary(b); err != nil {
		return "", err
	}
	file := `"$st/bin/` + b.name + `"`
	// Probe: is the helper there, whole, and its server answering? If it
	// is not there, what platform is this?
	probe := gitsync.InCheckout(`f=` + file + `
if [ -x "$f" ] && v=$("$f" version 2>/dev/null) && [ "$v" = "` + helperproto.Name + ` ` + b.sum + `" ]; then exec "$f" ping -state "$st"; fi
uname -sm; exit ` + fmt.Sprint(probeMissing) + "\n")
	var out bytes.Buffer
	pctx, cancel := context.WithTimeout(ctx, probeTimeout)
	status, err := c.ExecOnce(pctx, probe, sshpool.Stdio{Stdout: &limited{w: &out, n: 4096}, Stderr: io.Discard})
	cancel()
	if err != nil {
		return "", fmt.Errorf("probe: %w", err)
	}
	switch status.Code {
	case 0:
		return readyLine(out.Bytes())
	case helperproto.ExitNotServing:
	case probeMissing:
		if got := strings.TrimSpace(out.String()); got != m.o.Platform {
			return "", fmt.Errorf("%w: the sandbox is %q, the helper is for %q", errPlatform, printable(got, 64), m.o.Platform)
		}
		if err := m.install(ctx, c, b, file); err != nil {
			return "", err
		}
	default:
		return "", fmt.Errorf("probe: exit %d", status.Code)
	}
	// The server, as a managed process: it outlives this connection, and
	// a start replaces the process of the same name (an older binary's).
	command := `[ -d .git ] && gd="$PWD/.git" || gd=$(git -c safe.directory='*' rev-parse --absolute-git-dir) && exec "$gd/sandboxd/bin/` + b.name + `" serve -state "$gd/sandboxd"`
	rec, err := m.directive(ctx, c, directiveStart, map[string]any{"key": helperproto.ProcessKey, "command": command})
	if err != nil {
		return "", err
	}
	if rec.Status != "running" {
		return "", fmt.Errorf("the helper's server is %s right after its start (its stderr in the sandbox: %s)", rec.Status, rec.StderrPath)
	}
	out.Reset()
	rctx, cancel := context.WithTimeout(ctx, readyTimeout+probeTimeout)
	defer cancel()
	wait := gitsync.InCheckout(`exec ` + file + ` ping -state "$st" -wait ` + readyTimeout.String() + "\n")
	status, err = c.ExecOnce(rctx, wait, sshpool.Stdio{Stdout: &limited{w: &out, n: 4096}, Stderr: io.Discard})
	switch {
	case err != nil:
		return "", fmt.Errorf("wait for the helper's server: %w", err)
	case status.Code != 0:
		return "", fmt.Errorf("the helper's server did not answer within %s of its start (exit %d; its stderr in the sandbox: %s)", readyTimeout, status.Code, rec.StderrPath)
	}
	return readyLine(out.Bytes())
}

// readyLine reads ping's answer, "ready <instance>".
func readyLine(out []byte) (string, error) {
	line, _, _ := bytes.Cut(out, []byte("\n"))
	inst, ok := strings.CutPrefix(string(line), helperproto.Ready)
	if !ok || !validInstance(inst) {
		return "", fmt.Errorf("the helper's ping answered %q, not a ready line", printable(string(line), 80))
	}
	return inst, nil
}

// processRecord is the part of the agent's answer used here.
type processRecord struct {
	Key        string `json:"key"`
	Status     string `json:"status"`
	StderrPath string `json:"stderrPath"`
}

// directive sends a managed-process directive and reads its record, which
// comes from the sandbox: bounded, and refused unless it is one record of
// the process asked about.
func (m *Manager) directive(ctx context.Context, c Conn, name string, req map[string]any) (processRecord, error) {
	payload, err := json.Marshal(req)
	if err != nil {
		return processRecord{}, fmt.Errorf("encode the %s request: %w", name, err)
	}
	ctx, cancel := context.WithTimeout(ctx, directiveTimeout)
	defer cancel()
	var out, errb bytes.Buffer
	stdout := &limited{w: &out, n: 16 << 10}
	st, err := c.ExecOnce(ctx, name+" "+string(payload), sshpool.Stdio{Stdout: stdout, Stderr: &limited{w: &errb, n: 1024}})
	switch {
	case err != nil:
		return processRecord{}, fmt.Errorf("%s: %w", name, err)
	case st.Code == 127:
		return processRecord{}, errNoProcesses
	case st.Code != 0:
		return processRecord{}, fmt.Errorf("the sandbox agent refused %s: exit %d: %s", name, st.Code, printable(strings.TrimSpace(errb.String()), 256))
	case stdout.n == 0:
		return processRecord{}, fmt.Errorf("the sandbox agent's answer to %s is over 16 KiB: refused", name)
	}
	var rec processRecord
	dec := json.NewDecoder(bytes.NewReader(out.Bytes()))
	if err := dec.Decode(&rec); err != nil {
		return processRecord{}, fmt.Errorf("the sandbox agent's answer to %s is not a process record: %w", name, err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return processRecord{}, fmt.Errorf("the sandbox agent's answer to %s holds more than one record: refused", name)
	}
	if rec.Key != helperproto.ProcessKey {
		return processRecord{}, fmt.Errorf("the sandbox agent answered %s for process %q: refused", name, printable(rec.Key, 64))
	}
	rec.Status, rec.StderrPath = printable(rec.Status, 32), printable(rec.StderrPath, 256)
	return rec, nil
}

// printable is s cut to n bytes with control characters replaced: text
// from the sandbox, for logs and messages.
func printable(s string, n int) string {
	if len(s) > n {
		s = s[:n] + "..."
	}
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return '?'
		}
		return r
	}, s)
}

// install uploads the binary (written under a temporary name, checked by
// its hash, then renamed) and removes other versions.
func (m *Manager) install(ctx context.Context, c Conn, b *binFile, file string) error {
	bin, err := os.ReadFile(b.path)
	if err != nil {
		return fmt.Errorf("install: %w", err)
	}
	if hashOf(bin) != b.sum {
		// Replaced on disk (an upgrade): the sandbox would get a binary
		// other than the one named; the next daemon names the new one.
		return errors.New("install: the helper binary changed since sandboxd started")
	}
	script := gitsync.InCheckout(`f=` + file + `
mkdir -p "$st/bin" || exit 1
t="$st/bin/.install.$$"
cat >"$t" && chmod 755 "$t" && v=$("$t" version) && [ "$v" = "` + helperproto.Name + ` ` + b.sum + `" ] && mv -f "$t" "$f" || { rm -f "$t"; exit 1; }
for o in "$st"/bin/` + helperproto.Name + `-*; do [ "$o" = "$f" ] || rm -f "$o"; done
`)
	var stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(ctx, installTimeout)
	defer cancel()
	status, err := c.ExecOnce(ctx, script, sshpool.Stdio{Stdin: bytes.NewReader(bin), Stdout: io.Discard, Stderr: &limited{w: &stderr, n: 4096}})
	if err != nil {
		return fmt.Errorf("install: %w", err)
	}
	if status.Code != 0 {
		return fmt.Errorf("install: exit %d: %s", status.Code, strings.TrimSpace(stderr.String()))
	}
	m.log.Debug("sandbox helper installed", "bytes", len(bin))
	return nil
}

func validInstance(s string) bool {
	if len(s) == 0 || len(s) > 64 {
		return false
	}
	for _, r := range s {
		if !(r >= '0' && r <= '9' || r >= 'a' && r <= 'f') {
			return false
		}
	}
	return true
}

// limited keeps the first n bytes written.
type limited struct {
	w io.Writer
	n int
}

func (l *limited) Write(p []byte) (int, error) {
	if k := min(len(p), l.n); k > 0 {
		_, _ = l.w.Write(p[:k])
		l.n -= k
	}
	return len(p), nil
}

// Platform is what `uname -sm` prints on a Linux machine of goarch, ""
// for a platform the helper does not serve.
func Platform(goos, goarch string) string {
	if goos != "linux" {
		return ""
	}
	switch goarch {
	case "amd64":
		return "Linux x86_64"
	case "arm64":
		return "Linux aarch64"
	}
	return ""
}

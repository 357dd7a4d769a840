// Package helper installs sandboxd-helper (package sandboxhelper) in the
// sandboxes and keeps its server running over each kept connection, so
// that the sync scripts stage only what changed. It never stands in the
// way: until the helper serves on a connection, and wherever it cannot
// (another platform, no binary, an install that failed), the scripts stage
// the whole tree as they always did.
package helper

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
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

// Conn is the connection the helper runs over (*sshpool.Conn).
type Conn interface {
	ExecOnce(ctx context.Context, command string, stdio sshpool.Stdio) (sshpool.ExitStatus, error)
	Done() <-chan struct{}
}

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
	// platform is never tried again on the connection.
	RetryAfter time.Duration
	Now        func() time.Time
}

// Manager runs the helper's server once per connection.
type Manager struct {
	o    Options
	log  *slog.Logger
	ctx  context.Context
	stop context.CancelFunc

	mu    sync.Mutex
	bin   *binFile // nil: the helper is off
	conns map[Conn]*state
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
	bin      *binFile           // the binary this connection's server runs
	cancel   context.CancelFunc // stops the server (a reload changed the binary)
	instance string             // set once the server answers
	failed   time.Time          // the last try failed at this time
	wait     time.Duration
	never    bool // the sandbox cannot run this helper
	running  bool
}

// New returns a Manager; nothing runs until For is called.
func New(o Options) *Manager {
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.RetryAfter <= 0 {
		o.RetryAfter = time.Minute
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	ctx, stop := context.WithCancel(context.Background())
	m := &Manager{o: o, log: o.Logger, ctx: ctx, stop: stop, conns: map[Conn]*state{}}
	if o.Binary != "" {
		m.bin = &binFile{path: o.Binary}
	}
	return m
}

// SetBinary switches the helper to another binary, or off with "" (a
// reloaded configuration). The servers of the previous one stop; each
// connection starts the new one on its next use.
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
		if st.cancel != nil {
			st.cancel()
		}
	}
	m.conns = map[Conn]*state{}
	m.log.Info("sandbox helper changed", "binary", path)
}

// For returns the installed helper's file name (under the sandbox's
// .git/sandboxd/bin) and its server's instance once the server answers on
// c; until then "" and "", having started it in the background.
func (m *Manager) For(c Conn) (name, instance string) {
	if m == nil {
		return "", ""
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.bin == nil || m.ctx.Err() != nil {
		return "", ""
	}
	st := m.conns[c]
	switch {
	case st == nil:
		st = &state{bin: m.bin}
		m.conns[c] = st
	case st.instance != "":
		return st.bin.name, st.instance
	case st.running || st.never || m.o.Now().Sub(st.failed) < st.wait:
		return "", ""
	}
	st.running = true
	ctx, cancel := context.WithCancel(m.ctx)
	st.cancel = cancel
	m.wg.Add(1)
	go m.run(ctx, c, st)
	return "", ""
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
	st := m.conns[c]
	if st == nil || st.running || st.instance != "" {
		return false
	}
	return st.never || m.o.Now().Sub(st.failed) < st.wait
}

// Close stops every server (their exec requests end) and waits.
func (m *Manager) Close() {
	m.stop()
	m.wg.Wait()
}

// run installs the helper on c when it is missing and runs its server
// until the connection ends or st.cancel is called (ctx is st's).
func (m *Manager) run(ctx context.Context, c Conn, st *state) {
	defer m.wg.Done()
	defer st.cancel()
	go func() {
		select {
		case <-c.Done():
			st.cancel()
		case <-ctx.Done():
		}
	}()
	err := m.serve(ctx, c, st)
	m.mu.Lock()
	defer m.mu.Unlock()
	st.running, st.instance = false, ""
	if m.conns[c] != st {
		return // the binary changed: this state is gone
	}
	select {
	case <-c.Done():
		delete(m.conns, c)
		return
	default:
	}
	if m.ctx.Err() == nil {
		st.failed = m.o.Now()
		st.wait = min(max(2*st.wait, m.o.RetryAfter), time.Hour)
		st.never = errors.Is(err, errPlatform)
		// Another platform is expected and says so once per connection at
		// debug level; anything else is worth a look (a sandbox that
		// cannot run it, a broken upload) and costs speed, not results.
		level := slog.LevelWarn
		if st.never {
			level = slog.LevelDebug
		}
		m.log.Log(context.Background(), level, "sandbox helper not running: synced execs scan the sandbox's whole tree", "retry_in", st.wait, "err", err)
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

// Deadlines of the helper's steps in a sandbox, which may never answer:
// each failure is tried again later, the scripts meanwhile stage the
// whole tree.
const (
	probeTimeout   = 30 * time.Second
	installTimeout = 2 * time.Minute
	readyTimeout   = 30 * time.Second
)

// Exit codes of the probe.
const (
	probeMissing = 3 // not installed (or damaged): its platform follows
)

func (m *Manager) serve(ctx context.Context, c Conn, st *state) error {
	b := st.bin
	if err := m.loadBinary(b); err != nil {
		return err
	}
	file := `"$st/bin/` + b.name + `"`
	// Probe: is the helper there, whole? If not, what platform is this?
	var out bytes.Buffer
	probe := gitsync.InCheckout(`f=` + file + `
if [ -x "$f" ] && v=$("$f" version 2>/dev/null) && [ "$v" = "` + helperproto.Name + ` ` + b.sum + `" ]; then exit 0; fi
uname -sm; exit ` + fmt.Sprint(probeMissing) + "\n")
	pctx, cancel := context.WithTimeout(ctx, probeTimeout)
	status, err := c.ExecOnce(pctx, probe, sshpool.Stdio{Stdout: &limited{w: &out, n: 4096}, Stderr: io.Discard})
	cancel()
	if err != nil {
		return fmt.Errorf("probe: %w", err)
	}
	switch status.Code {
	case 0:
	case probeMissing:
		if got := strings.TrimSpace(out.String()); got != m.o.Platform {
			return fmt.Errorf("%w: the sandbox is %q, the helper is for %q", errPlatform, got, m.o.Platform)
		}
		if err := m.install(ctx, c, b, file); err != nil {
			return err
		}
	default:
		return fmt.Errorf("probe: exit %d", status.Code)
	}
	// The server: one exec request for the connection's life. Its stdin
	// stays open until ctx ends; closing it stops the server.
	pr, pw := io.Pipe()
	defer pw.Close()
	stop := context.AfterFunc(ctx, func() { _ = pw.Close() })
	defer stop()
	lines := &lineWatcher{ready: make(chan string, 1)}
	done := make(chan error, 1)
	go func() {
		_, err := c.ExecOnce(ctx, gitsync.InCheckout(`exec `+file+` serve -state "$st"`+"\n"), sshpool.Stdio{Stdin: pr, Stdout: lines, Stderr: io.Discard})
		done <- err
	}()
	select {
	case inst := <-lines.ready:
		m.mu.Lock()
		st.instance = inst
		m.mu.Unlock()
		m.log.Debug("sandbox helper serving", "instance", inst)
	case err := <-done:
		return fmt.Errorf("the helper's server ended before answering: %v", err)
	case <-time.After(readyTimeout):
		// Its stdin closes (pw) and the request ends: tried again later.
		return fmt.Errorf("the helper's server did not say it was ready within %s", readyTimeout)
	case <-ctx.Done():
		// The exec request ends with ctx (TERM, which the server obeys).
		<-done
		return ctx.Err()
	}
	return <-done
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

// lineWatcher passes the server's first line, "ready <instance>", on.
type lineWatcher struct {
	buf   []byte
	ready chan string
	seen  bool
}

func (l *lineWatcher) Write(p []byte) (int, error) {
	if l.seen {
		return len(p), nil
	}
	l.buf = append(l.buf, p...)
	line, _, complete := bytes.Cut(l.buf, []byte("\n"))
	if !complete && len(l.buf) <= 256 {
		return len(p), nil
	}
	l.seen = true
	if inst, ok := strings.CutPrefix(string(line), helperproto.Ready); complete && ok && validInstance(inst) {
		l.ready <- inst
	}
	return len(p), nil
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

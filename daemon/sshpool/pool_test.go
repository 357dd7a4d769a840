package sshpool

import (
	"bytes"
	"context"
	"errors"
	"io"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/internal/testutil"
)

// testOptions are short intervals for tests; keepalive timeouts stay
// generous so that a slow (race-instrumented) machine never looks dead.
func testOptions() Options {
	return Options{
		DialTimeout:       5 * time.Second,
		KeepaliveInterval: 50 * time.Millisecond,
		KeepaliveTimeout:  5 * time.Second,
		ReconnectMin:      5 * time.Millisecond,
		ReconnectMax:      50 * time.Millisecond,
		KillGrace:         300 * time.Millisecond,
	}
}

func newPool(t *testing.T, opts Options) *testPool {
	t.Helper()
	p := newTestPool(opts)
	t.Cleanup(func() { p.Close() })
	return p
}

// testPool gives the tests one link per run id, as each sandbox's
// controller owns one.
type testPool struct {
	*Pool
	mu    sync.Mutex
	links map[string]*Link
}

func newTestPool(opts Options) *testPool {
	return &testPool{Pool: New(opts), links: map[string]*Link{}}
}

func (p *testPool) link(runID string) *Link {
	p.mu.Lock()
	defer p.mu.Unlock()
	l, ok := p.links[runID]
	if !ok {
		l = p.NewLink(nil)
		p.links[runID] = l
	}
	return l
}

func (p *testPool) Get(ctx context.Context, t Target) (*Conn, error) {
	return p.link(t.RunID).Get(ctx, t)
}

func (p *testPool) Ensure(t Target) { p.link(t.RunID).Ensure(t) }

func (p *testPool) Forget(runID string) {
	p.link(runID).Forget()
	p.mu.Lock()
	delete(p.links, runID)
	p.mu.Unlock()
}

func (p *testPool) Connected(runID string) bool { return p.link(runID).Connected() }

// stateLog records OnState events.
type stateLog struct {
	mu     sync.Mutex
	events []stateEvent
}

type stateEvent struct {
	up  bool
	err error
}

func (l *stateLog) record(_ string, up bool, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events = append(l.events, stateEvent{up, err})
}

func (l *stateLog) snapshot() []stateEvent {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]stateEvent(nil), l.events...)
}

// waitEvent waits until an event matching ok has been recorded, and returns
// it.
func (l *stateLog) waitEvent(t *testing.T, what string, ok func(stateEvent) bool) stateEvent {
	t.Helper()
	var found stateEvent
	waitFor(t, what, func() bool {
		for _, e := range l.snapshot() {
			if ok(e) {
				found = e
				return true
			}
		}
		return false
	})
	return found
}

func (l *stateLog) count(up bool) int {
	n := 0
	for _, e := range l.snapshot() {
		if e.up == up {
			n++
		}
	}
	return n
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func execOK(t *testing.T, c *Conn, command string, stdio Stdio) ExitStatus {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := c.Exec(ctx, command, stdio)
	if err != nil {
		t.Fatalf("exec %q: %v", command, err)
	}
	return st
}

func TestExecStreamsStdinStdoutStderrAndStatus(t *testing.T) {
	srv := newTestServer(t)
	p := newPool(t, testOptions())
	c, err := p.Get(context.Background(), srv.target("run-1"))
	if err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	st := execOK(t, c, "cat; echo to-stderr >&2; exit 7", Stdio{
		Stdin: strings.NewReader("hello\nworld\n"), Stdout: &stdout, Stderr: &stderr,
	})
	if st != (ExitStatus{Code: 7}) {
		t.Errorf("status %+v, want code 7", st)
	}
	if stdout.String() != "hello\nworld\n" || stderr.String() != "to-stderr\n" {
		t.Errorf("stdout %q stderr %q", stdout.String(), stderr.String())
	}

	// Nil stdin is an immediate EOF, not a hang.
	var out bytes.Buffer
	if st := execOK(t, c, "wc -c", Stdio{Stdout: &out}); st.Code != 0 || strings.TrimSpace(out.String()) != "0" {
		t.Errorf("wc -c with no stdin: %+v %q", st, out.String())
	}
}

func TestManyExecsOneHandshake(t *testing.T) {
	srv := newTestServer(t)
	p := newPool(t, testOptions())
	tg := srv.target("run-1")
	for i := range 20 {
		c, err := p.Get(context.Background(), tg)
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		execOK(t, c, "echo $((1+"+string(rune('0'+i%10))+"))", Stdio{Stdout: &out})
		if out.Len() == 0 {
			t.Fatalf("exec %d printed nothing", i)
		}
	}
	if h := p.Handshakes(); h != 1 {
		t.Errorf("Handshakes = %d, want 1", h)
	}
	if a := srv.accepted.Load(); a != 1 {
		t.Errorf("server accepted %d connections, want 1", a)
	}
	if !p.Connected("run-1") || p.Live() != 1 {
		t.Errorf("Connected=%v Live=%d", p.Connected("run-1"), p.Live())
	}
}

// An exec runs on a session channel that was opened before Exec was called,
// and the agent gets its request before the open of the channel replacing
// that spare (sent first, the open would be served first, on the exec's
// path).
func TestSpareSessionIsUsed(t *testing.T) {
	srv := newTestServer(t)
	p := newPool(t, testOptions())
	c, err := p.Get(context.Background(), srv.target("run-1"))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		// The spares for exec i are open on the server before exec i starts.
		waitFor(t, "the spare sessions", func() bool { return srv.opens.Load() == int64(i+spareSessions) })
		openedBefore := srv.opens.Load()
		execOK(t, c, "true", Stdio{})
		log := srv.execLog()
		last := log[len(log)-1]
		if last.channel > openedBefore {
			t.Fatalf("exec %d ran on channel %d, opened after the exec began (%d were open before)", i, last.channel, openedBefore)
		}
		if last.opened != openedBefore {
			t.Fatalf("exec %d reached the server after %d channel opens, want %d: the next spare's open went first", i, last.opened, openedBefore)
		}
	}
}

// Two execs in a row, the second sent before any channel could have been
// opened for it (the lock request, then the command, after an idle lease),
// both run on channels opened ahead of use.
func TestTwoExecsInARowWaitForNoChannelOpen(t *testing.T) {
	srv := newTestServer(t)
	p := newPool(t, testOptions())
	c, err := p.Get(context.Background(), srv.target("run-1"))
	if err != nil {
		t.Fatal(err)
	}
	for round := range 3 {
		waitFor(t, "the spare sessions", func() bool {
			c.mu.Lock()
			defer c.mu.Unlock()
			if len(c.spares) != spareSessions {
				return false
			}
			for _, sc := range c.spares {
				select {
				case <-sc.done:
				default:
					return false
				}
			}
			return true
		})
		openedBefore := srv.opens.Load()
		// A channel opened once the first exec began (the spare it
		// replaces) is numbered above openedBefore.
		execOK(t, c, "true # lock", Stdio{})
		execOK(t, c, "true # command", Stdio{})
		log := srv.execLog()
		for _, r := range log[len(log)-2:] {
			if r.channel > openedBefore {
				t.Fatalf("round %d: %q ran on channel %d, opened after the execs began (%d were open before)", round, r.command, r.channel, openedBefore)
			}
		}
	}
}

// Spares the agent closed meanwhile are discarded, and the exec still runs.
func TestDeadSpareIsDiscarded(t *testing.T) {
	srv := newTestServer(t)
	p := newPool(t, testOptions())
	c, err := p.Get(context.Background(), srv.target("run-1"))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the spare sessions", func() bool { return srv.opens.Load() == spareSessions })
	c.mu.Lock()
	spares := append([]*spareCall(nil), c.spares...)
	c.mu.Unlock()
	for _, sc := range spares {
		<-sc.done
		sc.s.ch.Close() // as if the agent closed it
		<-sc.s.closed
	}
	var out bytes.Buffer
	execOK(t, c, "echo fine", Stdio{Stdout: &out})
	if out.String() != "fine\n" {
		t.Fatalf("stdout %q", out.String())
	}
	if h := p.Handshakes(); h != 1 {
		t.Errorf("a dead spare cost a new handshake (%d)", h)
	}
}

func TestKeepaliveDetectsDeadConnectionAndReconnects(t *testing.T) {
	srv := newTestServer(t)
	var states stateLog
	opts := testOptions()
	opts.KeepaliveInterval, opts.KeepaliveTimeout = 20*time.Millisecond, 150*time.Millisecond
	opts.OnState = states.record
	p := newPool(t, opts)
	p.Ensure(srv.target("run-1"))
	states.waitEvent(t, "connection up", func(e stateEvent) bool { return e.up })

	srv.muteKeepalive.Store(true)
	down := states.waitEvent(t, "keepalive timeout", func(e stateEvent) bool { return !e.up })
	if !errors.Is(down.err, ErrKeepaliveTimeout) {
		t.Fatalf("down because %v, want a keepalive timeout", down.err)
	}
	srv.muteKeepalive.Store(false)
	waitFor(t, "reconnect", func() bool { return states.count(true) >= 2 && p.Connected("run-1") })
	if h := p.Handshakes(); h < 2 {
		t.Errorf("Handshakes = %d, want a new one after the dead connection", h)
	}
}

func TestReconnectWithBackoffCheckingAliveFirst(t *testing.T) {
	srv := newTestServer(t)
	var states stateLog
	var (
		mu      sync.Mutex
		backoff []time.Duration
	)
	var checks atomic.Int32
	opts := testOptions()
	// Keepalives far away: every other wait is a reconnect backoff.
	opts.KeepaliveInterval, opts.KeepaliveTimeout = time.Hour, time.Hour
	opts.ReconnectMin, opts.ReconnectMax = 2*time.Millisecond, 16*time.Millisecond
	opts.After = func(d time.Duration) <-chan time.Time {
		if d != time.Hour {
			mu.Lock()
			backoff = append(backoff, d)
			mu.Unlock()
		}
		return time.After(d)
	}
	opts.CheckAlive = func(ctx context.Context, runID string) error {
		if runID != "run-1" {
			t.Errorf("CheckAlive(%q)", runID)
		}
		checks.Add(1)
		return nil
	}
	opts.OnState = states.record
	p := newPool(t, opts)
	p.Ensure(srv.target("run-1"))
	states.waitEvent(t, "connection up", func(e stateEvent) bool { return e.up })
	if checks.Load() != 0 {
		t.Errorf("CheckAlive called before the first connect")
	}

	srv.refuse.Store(true) // reconnects fail until further notice
	srv.dropAll()
	waitFor(t, "five reconnect attempts", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(backoff) >= 5
	})
	srv.refuse.Store(false)
	waitFor(t, "reconnect", func() bool { return states.count(true) >= 2 && p.Connected("run-1") })

	mu.Lock()
	got := append([]time.Duration(nil), backoff[:5]...)
	mu.Unlock()
	want := []time.Duration{2 * time.Millisecond, 4 * time.Millisecond, 8 * time.Millisecond, 16 * time.Millisecond, 16 * time.Millisecond}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("backoffs %v, want %v (doubling from ReconnectMin, capped)", got, want)
		}
	}
	if c := checks.Load(); c < 5 {
		t.Errorf("CheckAlive called %d times for at least 5 reconnect attempts", c)
	}
}

func TestGoneRunIsNotReconnected(t *testing.T) {
	srv := newTestServer(t)
	var states stateLog
	opts := testOptions()
	opts.OnState = states.record
	var checks atomic.Int32
	opts.CheckAlive = func(context.Context, string) error {
		checks.Add(1)
		return errdefs.Gone(errors.New("run finished"))
	}
	p := newPool(t, opts)
	p.Ensure(srv.target("run-1"))
	states.waitEvent(t, "connection up", func(e stateEvent) bool { return e.up })

	srv.dropAll()
	final := states.waitEvent(t, "give up", func(e stateEvent) bool { return !e.up && errors.Is(e.err, errdefs.ErrGone) })
	if !strings.Contains(final.err.Error(), "run finished") {
		t.Errorf("reason %v", final.err)
	}
	if h := p.Handshakes(); h != 1 {
		t.Errorf("Handshakes = %d: a gone run was dialed again", h)
	}
	if p.Connected("run-1") || checks.Load() != 1 {
		t.Errorf("Connected=%v checks=%d", p.Connected("run-1"), checks.Load())
	}
}

// The exec request reached the agent, then the connection died: the error
// says so and the command is not run again.
func TestLostExecIsNeverResent(t *testing.T) {
	srv := newTestServer(t)
	p := newPool(t, testOptions())
	c, err := p.Get(context.Background(), srv.target("run-1"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Exec(context.Background(), dropCommand, Stdio{})
	if !errors.Is(err, ErrConnectionLost) || errors.Is(err, ErrNotSent) {
		t.Fatalf("err = %v, want ErrConnectionLost only", err)
	}
	if n := srv.runCount(dropCommand); n != 1 {
		t.Fatalf("the command reached the agent %d times, want exactly 1", n)
	}
	// The pool recovers for the next command.
	c2, err := p.Get(context.Background(), srv.target("run-1"))
	if err != nil {
		t.Fatal(err)
	}
	execOK(t, c2, "true", Stdio{})
	if n := srv.runCount(dropCommand); n != 1 {
		t.Fatalf("the lost command was re-run (%d)", n)
	}
}

// A connection that died between two execs: the second exec is not sent on
// it, reconnects once, and runs exactly once.
func TestNotSentIsRetriedOnceOnAFreshConnection(t *testing.T) {
	srv := newTestServer(t)
	p := newPool(t, testOptions())
	c, err := p.Get(context.Background(), srv.target("run-1"))
	if err != nil {
		t.Fatal(err)
	}
	execOK(t, c, "true", Stdio{})
	srv.dropAll()
	waitFor(t, "the drop to be noticed", func() bool { return !p.Connected("run-1") })

	var out bytes.Buffer
	execOK(t, c, "echo second", Stdio{Stdout: &out}) // on the old, dead *Conn
	if out.String() != "second\n" {
		t.Errorf("stdout %q", out.String())
	}
	if n := srv.runCount("echo second"); n != 1 {
		t.Errorf("ran %d times, want 1", n)
	}
	if h := p.Handshakes(); h != 2 {
		t.Errorf("Handshakes = %d, want 2", h)
	}

	// When the retry cannot connect either, the error says nothing was sent.
	srv.refuse.Store(true)
	srv.dropAll()
	waitFor(t, "the drop to be noticed", func() bool { return !p.Connected("run-1") })
	_, err = c.Exec(context.Background(), "echo third", Stdio{})
	if !errors.Is(err, ErrNotSent) {
		t.Fatalf("err = %v, want ErrNotSent", err)
	}
	if n := srv.runCount("echo third"); n != 0 {
		t.Errorf("an unsent command ran %d times", n)
	}
}

// lineWatcher is a Writer that signals when a line appears.
type lineWatcher struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	want string
	seen chan struct{}
	once sync.Once
}

func newLineWatcher(want string) *lineWatcher {
	return &lineWatcher{want: want, seen: make(chan struct{})}
}

func (w *lineWatcher) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if strings.Contains(w.buf.String(), w.want) {
		w.once.Do(func() { close(w.seen) })
	}
	return len(p), nil
}

func (w *lineWatcher) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

func (w *lineWatcher) wait(t *testing.T) {
	t.Helper()
	select {
	case <-w.seen:
	case <-time.After(10 * time.Second):
		t.Fatalf("never saw %q in %q", w.want, w.String())
	}
}

func TestCancelKillsRemoteCommand(t *testing.T) {
	srv := newTestServer(t)
	p := newPool(t, testOptions())
	c, err := p.Get(context.Background(), srv.target("run-1"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, command, wantSignal string
	}{
		{"TERM ends it", "echo started; exec sleep 30", "TERM"},
		{"KILL after the grace", "trap '' TERM; echo started; while :; do sleep 0.05; done", "KILL"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := newLineWatcher("started")
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			var st ExitStatus
			var err error
			go func() { st, err = c.Exec(ctx, tc.command, Stdio{Stdout: out}); close(done) }()
			out.wait(t)
			cancel()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("Exec did not return after cancel")
			}
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("err = %v, want context.Canceled", err)
			}
			if tc.wantSignal == "TERM" && st.Signal != "TERM" {
				t.Errorf("status %+v, want killed by TERM", st)
			}
			waitFor(t, "the remote process to end", func() bool {
				srv.mu.Lock()
				defer srv.mu.Unlock()
				return len(srv.procs) == 0
			})
		})
	}
	// The connection survives a cancelled command.
	execOK(t, c, "true", Stdio{})
	if h := p.Handshakes(); h != 1 {
		t.Errorf("Handshakes = %d, want 1", h)
	}
}

func TestSignalsAreForwarded(t *testing.T) {
	srv := newTestServer(t)
	p := newPool(t, testOptions())
	c, err := p.Get(context.Background(), srv.target("run-1"))
	if err != nil {
		t.Fatal(err)
	}
	out := newLineWatcher("ready")
	signals := make(chan ssh.Signal, 1)
	done := make(chan ExitStatus, 1)
	go func() {
		done <- execOK(t, c, "trap 'echo got-INT; exit 130' INT; echo ready; while :; do sleep 0.05; done", Stdio{Stdout: out, Signals: signals})
	}()
	out.wait(t)
	signals <- ssh.SIGINT
	select {
	case st := <-done:
		if st.Code != 130 || !strings.Contains(out.String(), "got-INT") {
			t.Errorf("status %+v output %q", st, out.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("SIGINT did not reach the command")
	}

	// A command killed by a signal reports its name.
	if st := execOK(t, c, "kill -USR1 $$", Stdio{}); st != (ExitStatus{Code: -1, Signal: "USR1"}) {
		t.Errorf("status %+v, want killed by USR1", st)
	}
}

func TestHostKeyMismatchIsRefused(t *testing.T) {
	srv := newTestServer(t)
	other := newTestServer(t)
	p := newPool(t, testOptions())
	tg := srv.target("run-1")
	tg.PublicHostKey = other.hostPub
	_, err := p.Get(context.Background(), tg)
	if !errors.Is(err, ErrHostKeyMismatch) {
		t.Fatalf("err = %v, want ErrHostKeyMismatch", err)
	}
	if !strings.Contains(err.Error(), "refusing to connect") || !strings.Contains(err.Error(), "run-1") {
		t.Errorf("unclear message: %v", err)
	}
	if srv.opens.Load() != 0 {
		t.Error("a session was opened on a server with the wrong host key")
	}
}

func TestBadTargets(t *testing.T) {
	srv := newTestServer(t)
	p := newPool(t, testOptions())
	good := srv.target("run-1")
	cases := map[string]func(*Target){
		"no address":        func(t *Target) { t.Address = "" },
		"garbage host key":  func(t *Target) { t.PublicHostKey = "not a key" },
		"garbage user key":  func(t *Target) { t.PrivateUserKey = "-----BEGIN NOTHING-----" },
		"nothing listening": func(t *Target) { t.Address = "127.0.0.1:1" },
	}
	for name, mod := range cases {
		tg := good
		mod(&tg)
		if _, err := p.Get(context.Background(), tg); err == nil {
			t.Errorf("%s: Get succeeded", name)
		} else if strings.Contains(err.Error(), "PRIVATE KEY") {
			t.Errorf("%s: error shows key material: %v", name, err)
		}
	}
}

func TestForgetClosesAndStopsReconnecting(t *testing.T) {
	srv := newTestServer(t)
	var states stateLog
	opts := testOptions()
	opts.OnState = states.record
	p := newPool(t, opts)
	p.Ensure(srv.target("run-1"))
	states.waitEvent(t, "connection up", func(e stateEvent) bool { return e.up })
	p.Forget("run-1")
	states.waitEvent(t, "connection down", func(e stateEvent) bool { return !e.up })
	if p.Connected("run-1") || p.Live() != 0 {
		t.Fatalf("Connected=%v Live=%d after Forget", p.Connected("run-1"), p.Live())
	}
	waitFor(t, "the server to see the close", func() bool {
		srv.mu.Lock()
		defer srv.mu.Unlock()
		return len(srv.conns) == 0
	})
	if h := p.Handshakes(); h != 1 {
		t.Errorf("Handshakes = %d: a forgotten sandbox was reconnected", h)
	}
}

func TestClosedPoolRefuses(t *testing.T) {
	srv := newTestServer(t)
	p := newTestPool(testOptions())
	p.Ensure(srv.target("run-1"))
	if _, err := p.Get(context.Background(), srv.target("run-2")); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Get(context.Background(), srv.target("run-1")); !errors.Is(err, ErrClosed) {
		t.Fatalf("Get after Close: %v", err)
	}
	if p.Live() != 0 {
		t.Fatalf("Live = %d after Close", p.Live())
	}
}

func TestConcurrentGetsShareOneDial(t *testing.T) {
	srv := newTestServer(t)
	p := newPool(t, testOptions())
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := p.Get(context.Background(), srv.target("run-1"))
			if err != nil {
				t.Error(err)
				return
			}
			execOK(t, c, "true", Stdio{})
		}()
	}
	wg.Wait()
	if h := p.Handshakes(); h != 1 {
		t.Errorf("Handshakes = %d, want 1 shared dial", h)
	}
}

func BenchmarkExecTrueWarm(b *testing.B) {
	srv := newTestServer(b)
	p := newTestPool(Options{})
	defer p.Close()
	tg := srv.target("run-1")
	ctx := context.Background()
	if _, err := p.Get(ctx, tg); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for b.Loop() {
		c, err := p.Get(ctx, tg)
		if err != nil {
			b.Fatal(err)
		}
		if st, err := c.Exec(ctx, "true", Stdio{}); err != nil || st.Code != 0 {
			b.Fatal(st, err)
		}
	}
	b.ReportMetric(float64(p.Handshakes()), "handshakes")
}

func BenchmarkExecTrueFreshConnection(b *testing.B) {
	srv := newTestServer(b)
	ctx := context.Background()
	tg := srv.target("run-1")
	for b.Loop() {
		p := newTestPool(Options{})
		c, err := p.Get(ctx, tg)
		if err != nil {
			b.Fatal(err)
		}
		if st, err := c.Exec(ctx, "true", Stdio{}); err != nil || st.Code != 0 {
			b.Fatal(st, err)
		}
		p.Close()
	}
}

// The remote restarted the agent elsewhere (new address and keys): Ensure
// with the new facts moves the connection there.
func TestEnsureFollowsNewConnectionDetails(t *testing.T) {
	first, second := newTestServer(t), newTestServer(t)
	var states stateLog
	opts := testOptions()
	opts.OnState = states.record
	p := newPool(t, opts)
	p.Ensure(first.target("run-1"))
	states.waitEvent(t, "connection up", func(e stateEvent) bool { return e.up })
	p.Ensure(second.target("run-1"))
	waitFor(t, "the move to the new address", func() bool { return second.accepted.Load() == 1 && p.Connected("run-1") })
	c, err := p.Get(context.Background(), second.target("run-1"))
	if err != nil {
		t.Fatal(err)
	}
	execOK(t, c, "echo moved", Stdio{})
	if second.runCount("echo moved") != 1 || first.runCount("echo moved") != 0 {
		t.Fatal("the exec did not run on the new agent")
	}
	if p.Live() != 1 {
		t.Fatalf("Live = %d, want 1", p.Live())
	}
}

// A failed SSH handshake says what may be wrong and what to do.
func TestHandshakeFailureGivesAdvice(t *testing.T) {
	srv := newTestServer(t)
	tg := srv.target("run-1")
	tg.Address = testutil.GarbageListener(t, "not ssh\r\n")
	p := newPool(t, Options{})
	_, err := p.Get(context.Background(), tg)
	if err == nil || !strings.Contains(err.Error(), "SSH handshake") || !strings.Contains(err.Error(), "nook status") {
		t.Fatalf("handshake with a non-SSH server: %v", err)
	}
}

// Send reaches the agent without waiting for anything, ahead of what is
// sent after it, and from the second Send on uses a channel opened before
// it was called, so it costs no round trip.
func TestSendWithoutWaiting(t *testing.T) {
	srv := newTestServer(t)
	p := newPool(t, testOptions())
	c, err := p.Get(context.Background(), srv.target("run-1"))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if i > 0 {
			// The Send spare is open before the Send.
			c.mu.Lock()
			sc := c.fire
			c.mu.Unlock()
			if sc == nil {
				t.Fatal("no Send spare prepared")
			}
			<-sc.done
		}
		openedBefore := srv.opens.Load()
		if err := c.Send(context.Background(), "true # marker"); err != nil {
			t.Fatal(err)
		}
		execOK(t, c, "true # command", Stdio{})
		// (The order the agent handles them in is the agent's business:
		// localcloud's agent keeps arrival order, see its sync markers.)
		waitFor(t, "the marker", func() bool { return srv.runCount("true # marker") == i+1 })
		for _, r := range srv.execLog() {
			if r.command == "true # marker" && i > 0 && r.channel > openedBefore && r.channel == srv.opens.Load() {
				t.Fatalf("send %d waited for a channel open (channel %d, %d open before)", i, r.channel, openedBefore)
			}
		}
	}
}

// The buffers that relay a command's streams are reused: an exec does not
// allocate 32 KiB per stream (io.Copy's own buffer; docs/performance.md
// says what that was worth). (Race builds drop some pooled buffers on
// purpose, hence a bound of half a buffer per relay, not zero.)
func TestRelayReusesItsBuffer(t *testing.T) {
	p := newPool(t, testOptions())
	out := newGate(io.Discard)
	relay := func() {
		// Only a Reader, as an SSH channel is: io.CopyBuffer then uses
		// the buffer it is given.
		p.relay(out, struct{ io.Reader }{strings.NewReader("some output\n")})
	}
	relay()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	const n = 100
	for range n {
		relay()
	}
	runtime.ReadMemStats(&after)
	if per := (after.TotalAlloc - before.TotalAlloc) / n; per >= copyBufSize/2 {
		t.Errorf("a relay allocates %d bytes, want less than half a %d-byte buffer", per, copyBufSize)
	}
}

// TestForgedExitReportsAreBounded: an agent's exit report is the sandbox's
// word: an exit status past 255 is read as 255, a signal name that is not
// one (terminal escapes, a flood) as UNKNOWN, and its message is cut.
func TestForgedExitReportsAreBounded(t *testing.T) {
	srv := newTestServer(t)
	p := newPool(t, testOptions())
	c, err := p.Get(context.Background(), srv.target("run-1"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		command string
		want    ExitStatus
	}{
		{"__test_exit_status__ 70000", ExitStatus{Code: 255}},
		{"__test_exit_status__ 4294967295", ExitStatus{Code: 255}},
		{"__test_exit_status__ 3", ExitStatus{Code: 3}},
		{"__test_exit_signal__ \x1b[2J", ExitStatus{Code: -1, Signal: "UNKNOWN"}},
		{"__test_exit_signal__ " + strings.Repeat("K", 5000), ExitStatus{Code: -1, Signal: "UNKNOWN"}},
		{"__test_exit_signal__ TERM", ExitStatus{Code: -1, Signal: "TERM"}},
	} {
		st, err := c.Exec(context.Background(), tc.command, Stdio{})
		if err != nil || st != tc.want {
			t.Errorf("%.40q: status %+v, %v; want %+v", tc.command, st, err, tc.want)
		}
	}
}

// TestChannelOpenThatIsNeverAnsweredEndsWithItsCaller: an agent that
// never answers a channel open (x/crypto/ssh's open has no deadline, and
// was seen waiting six minutes after a dropped connection) holds an exec
// only as long as its caller: it ends with ErrNotSent once ctx ends, and
// the connection is not closed for it.
func TestChannelOpenThatIsNeverAnsweredEndsWithItsCaller(t *testing.T) {
	srv := newTestServer(t)
	p := newPool(t, testOptions())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := p.Get(ctx, srv.target("run-1"))
	if err != nil {
		t.Fatal(err)
	}
	srv.muteOpens.Store(true)
	octx, ocancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer ocancel()
	began := time.Now()
	_, err = c.openSessionCtx(octx)
	if took := time.Since(began); err == nil || !errors.Is(err, context.DeadlineExceeded) || took > 5*time.Second {
		t.Fatalf("an unanswered channel open: %v after %s, want the caller's deadline within 5 s", err, took)
	}
	if !c.alive() {
		t.Fatal("the connection was closed for an open its caller gave up")
	}
}

// TestCloseEndsWhileAChannelOpenNeverDoes: x/crypto/ssh's channel open
// can wait for ever when the connection ends under it (its reader gone);
// the spare channels a connection opens ahead must not hold Close.
func TestCloseEndsWhileAChannelOpenNeverDoes(t *testing.T) {
	srv := newTestServer(t)
	never := make(chan struct{})
	defer close(never)
	p := newTestPool(testOptions())
	p.openChannel = func(*ssh.Client) (ssh.Channel, <-chan *ssh.Request, error) {
		<-never
		return nil, nil, errors.New("test over")
	}
	if _, err := p.Get(context.Background(), srv.target("run-1")); err != nil {
		t.Fatal(err)
	}
	closed := make(chan struct{})
	go func() { p.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close still waits 5 s later, for a channel open that never returns")
	}
}

// TestExecRequestNeverAnsweredEndsWithItsCaller: an agent that takes an
// exec request and never answers it, its connection otherwise fine,
// holds the exec only as long as its caller; the command is not sent
// again (it may have started).
func TestExecRequestNeverAnsweredEndsWithItsCaller(t *testing.T) {
	srv := newTestServer(t)
	p := newPool(t, testOptions())
	c, err := p.Get(context.Background(), srv.target("run-1"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	began := time.Now()
	_, err = c.Exec(ctx, silentCommand, Stdio{})
	if took := time.Since(began); !errors.Is(err, context.DeadlineExceeded) || took > 5*time.Second {
		t.Fatalf("an unanswered exec request: %v after %s, want the caller's deadline within 5 s", err, took)
	}
	if errors.Is(err, ErrNotSent) || srv.runCount(silentCommand) != 1 {
		t.Fatalf("the exec request reached the agent %d times (error %v): want once, never sent again", srv.runCount(silentCommand), err)
	}
	if !c.alive() {
		t.Fatal("the connection was closed for a request its caller gave up")
	}
	execOK(t, c, "true", Stdio{})
}

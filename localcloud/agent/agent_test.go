package agent

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

type fixture struct {
	agent  *Agent
	client *ssh.ClientConfig
	dir    string
	ended  atomic.Int32
}

func newSigner(t testing.TB) ssh.Signer {
	t.Helper()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	s, err := ssh.NewSignerFromKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func start(t testing.TB) *fixture {
	t.Helper()
	return startWith(t, func(*Config) {})
}

// startWith starts an agent with the fixture's configuration as adjust
// changes it.
func startWith(t testing.TB, adjust func(*Config)) *fixture {
	t.Helper()
	host, user := newSigner(t), newSigner(t)
	f := &fixture{dir: t.TempDir()}
	cfg := Config{
		HostKey:       host,
		AuthorizedKey: user.PublicKey(),
		Workspace:     f.dir,
		Env:           []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + f.dir, "LANG=C.UTF-8", "RWX_SANDBOX=1"},
		OnEnd:         func() { f.ended.Add(1) },
		OutputGrace:   200 * time.Millisecond,
	}
	adjust(&cfg)
	a, err := Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	f.agent = a
	f.client = &ssh.ClientConfig{
		User:            User,
		Auth:            []ssh.AuthMethod{ssh.PublicKeys(user)},
		HostKeyCallback: ssh.FixedHostKey(host.PublicKey()),
		Timeout:         10 * time.Second,
	}
	return f
}

func (f *fixture) dial(t testing.TB) *ssh.Client {
	t.Helper()
	c, err := ssh.Dial("tcp", f.agent.Addr(), f.client)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// run executes command and returns stdout, stderr and the exit status.
func run(t testing.TB, c *ssh.Client, command string, stdin string) (string, string, int) {
	t.Helper()
	s, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var out, errb bytes.Buffer
	s.Stdout, s.Stderr = &out, &errb
	if stdin != "" {
		s.Stdin = strings.NewReader(stdin)
	}
	err = s.Run(command)
	var exit *ssh.ExitError
	switch {
	case err == nil:
		return out.String(), errb.String(), 0
	case errors.As(err, &exit):
		return out.String(), errb.String(), exit.ExitStatus()
	default:
		t.Fatalf("run %q: %v", command, err)
		return "", "", -1
	}
}

func TestExecStreamsAndExitStatus(t *testing.T) {
	f := start(t)
	c := f.dial(t)
	out, errOut, code := run(t, c, "echo out; echo err >&2; pwd; exit 7", "")
	if out != "out\n"+f.dir+"\n" || errOut != "err\n" || code != 7 {
		t.Fatalf("got out=%q err=%q code=%d", out, errOut, code)
	}
	out, _, code = run(t, c, "wc -c", "hello")
	if strings.TrimSpace(out) != "5" || code != 0 {
		t.Fatalf("stdin: got %q code %d", out, code)
	}
	out, _, _ = run(t, c, "echo $PATH $LANG $RWX_SANDBOX", "")
	if out != "/usr/local/bin:/usr/bin:/bin C.UTF-8 1\n" {
		t.Fatalf("environment: %q", out)
	}
	// Every directive gets an exit status too, and prints nothing.
	for _, d := range []string{DirectiveLockRequested, DirectiveSyncStart, DirectiveSyncEnd, DirectiveLockReleased} {
		out, errOut, code := run(t, c, d, "")
		if out != "" || errOut != "" || code != 0 {
			t.Fatalf("%s: out=%q err=%q code=%d", d, out, errOut, code)
		}
	}
}

func TestEnvRequestAndKeepalive(t *testing.T) {
	f := start(t)
	c := f.dial(t)
	ok, _, err := c.SendRequest("keepalive@openssh.com", true, nil)
	if err != nil || !ok {
		t.Fatalf("keepalive: ok=%v err=%v", ok, err)
	}
	s, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Setenv("GREETING", "hi there"); err != nil {
		t.Fatal(err)
	}
	out, err := s.Output("echo \"$GREETING\"")
	if err != nil || string(out) != "hi there\n" {
		t.Fatalf("got %q, %v", out, err)
	}
}

func TestSignalReachesProcessGroup(t *testing.T) {
	f := start(t)
	c := f.dial(t)
	s, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	pidFile := filepath.Join(f.dir, "bg.pid")
	if err := s.Start("sleep 30 & echo $! > bg.pid; wait"); err != nil {
		t.Fatal(err)
	}
	bg := waitPID(t, pidFile)
	if err := s.Signal(ssh.SIGTERM); err != nil {
		t.Fatal(err)
	}
	err = s.Wait()
	var exit *ssh.ExitError
	if !errors.As(err, &exit) || exit.Signal() != "TERM" || exit.ExitStatus() != 128+15 {
		t.Fatalf("want death by TERM (143), got %v", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for syscall.Kill(bg, 0) == nil {
		if time.Now().After(deadline) {
			t.Fatalf("background process %d of the group survived the signal", bg)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestInterruptReportsSignal(t *testing.T) {
	f := start(t)
	c := f.dial(t)
	s, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Start("echo $$ > sh.pid; exec sleep 30"); err != nil {
		t.Fatal(err)
	}
	waitPID(t, filepath.Join(f.dir, "sh.pid"))
	// The pid file is written just before exec; give the exec a moment
	// by signalling until the command dies.
	if err := s.Signal(ssh.SIGINT); err != nil {
		t.Fatal(err)
	}
	err = s.Wait()
	var exit *ssh.ExitError
	if !errors.As(err, &exit) || exit.Signal() != "INT" || exit.ExitStatus() != 130 {
		t.Fatalf("want death by INT (130), got %v", err)
	}
}

func waitPID(t *testing.T, file string) int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, err := os.ReadFile(file)
		if err == nil && strings.HasSuffix(string(b), "\n") {
			pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
			if err == nil {
				return pid
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no pid in %s", file)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// requestLock sends the lock directive from c and reports on done when it
// is granted.
func requestLock(t *testing.T, c *ssh.Client, name string, order chan<- string) {
	t.Helper()
	s, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		defer s.Close()
		if err := s.Run(DirectiveLockRequested); err == nil {
			order <- name
		}
	}()
}

func (f *fixture) waitWaiters(t *testing.T, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		f.agent.lock.mu.Lock()
		got := len(f.agent.lock.waiters)
		f.agent.lock.mu.Unlock()
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("want %d lock waiters, have %d", n, got)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func TestLockFIFOAndReleaseOnDisconnect(t *testing.T) {
	f := start(t)
	c1, c2, c3 := f.dial(t), f.dial(t), f.dial(t)
	order := make(chan string, 3)
	requestLock(t, c1, "c1", order)
	if got := <-order; got != "c1" {
		t.Fatalf("first grant went to %s", got)
	}
	requestLock(t, c2, "c2", order)
	f.waitWaiters(t, 1)
	requestLock(t, c3, "c3", order)
	f.waitWaiters(t, 2)
	select {
	case got := <-order:
		t.Fatalf("%s got the lock while c1 holds it", got)
	default:
	}
	// A release from a connection that does not hold the lock changes
	// nothing.
	run(t, c3, DirectiveLockReleased, "")
	run(t, c1, DirectiveLockReleased, "")
	if got := <-order; got != "c2" {
		t.Fatalf("second grant went to %s, want c2 (FIFO)", got)
	}
	// c2 crashes while holding the lock: c3 is not deadlocked.
	c2.Close()
	select {
	case got := <-order:
		if got != "c3" {
			t.Fatalf("third grant went to %s", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("lock of a closed connection was never released")
	}
}

func TestLockWaiterThatLeavesIsSkipped(t *testing.T) {
	f := start(t)
	c1, c2, c3 := f.dial(t), f.dial(t), f.dial(t)
	order := make(chan string, 3)
	requestLock(t, c1, "c1", order)
	<-order
	requestLock(t, c2, "c2", order)
	f.waitWaiters(t, 1)
	requestLock(t, c3, "c3", order)
	f.waitWaiters(t, 2)
	c2.Close() // gives up while waiting
	f.waitWaiters(t, 1)
	run(t, c1, DirectiveLockReleased, "")
	if got := <-order; got != "c3" {
		t.Fatalf("grant went to %s, want c3", got)
	}
}

func TestEndDirective(t *testing.T) {
	f := start(t)
	c := f.dial(t)
	out, errOut, code := run(t, c, DirectiveEnd, "")
	if out != "" || errOut != "" || code != 0 {
		t.Fatalf("end: out=%q err=%q code=%d", out, errOut, code)
	}
	deadline := time.Now().Add(5 * time.Second)
	for f.ended.Load() != 1 {
		if time.Now().After(deadline) {
			t.Fatal("OnEnd was not called")
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func TestPTYAndWindowChange(t *testing.T) {
	f := start(t)
	c := f.dial(t)
	s, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.RequestPty("xterm", 40, 100, ssh.TerminalModes{}); err != nil {
		t.Fatal(err)
	}
	out, err := s.CombinedOutput("tty; stty size; echo $TERM")
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	got := strings.ReplaceAll(string(out), "\r", "")
	if !strings.Contains(got, "/dev/pts/") || !strings.Contains(got, "40 100\n") || !strings.Contains(got, "xterm\n") {
		t.Fatalf("pty output %q", got)
	}

	// Interactive shell with a resize in the middle.
	s2, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if err := s2.RequestPty("xterm", 24, 80, ssh.TerminalModes{}); err != nil {
		t.Fatal(err)
	}
	var buf testutil.LockedBuffer
	s2.Stdout = &buf
	stdin, err := s2.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := s2.Shell(); err != nil {
		t.Fatal(err)
	}
	if err := s2.WindowChange(33, 77); err != nil {
		t.Fatal(err)
	}
	stdin.Write([]byte("sleep 0.2; stty size; exit 3\n"))
	err = s2.Wait()
	var exit *ssh.ExitError
	if !errors.As(err, &exit) || exit.ExitStatus() != 3 {
		t.Fatalf("shell exit: %v", err)
	}
	if !strings.Contains(buf.String(), "33 77") {
		t.Fatalf("window change not applied: %q", buf.String())
	}
}

// TestAuthUsersAndKeys: both the RWX CLI's users (rwx-cli today, mint-cli
// before) log in with the run's key, neither with another key, and no other
// user at all.
func TestAuthUsersAndKeys(t *testing.T) {
	f := start(t)
	foreign := newSigner(t)
	for _, user := range []string{User, LegacyUser} {
		good := *f.client
		good.User = user
		c, err := ssh.Dial("tcp", f.agent.Addr(), &good)
		if err != nil {
			t.Fatalf("user %s with the run's key was refused: %v", user, err)
		}
		if out, _, code := run(t, c, "echo ok", ""); out != "ok\n" || code != 0 {
			t.Fatalf("user %s: exec answered %q, %d", user, out, code)
		}
		c.Close()
		bad := good
		bad.Auth = []ssh.AuthMethod{ssh.PublicKeys(foreign)}
		if c, err := ssh.Dial("tcp", f.agent.Addr(), &bad); err == nil {
			c.Close()
			t.Fatalf("user %s with a foreign key was accepted", user)
		}
	}
	other := *f.client
	other.User = "root"
	if c, err := ssh.Dial("tcp", f.agent.Addr(), &other); err == nil {
		c.Close()
		t.Fatal("user root was accepted")
	}
}

func TestDropConnectionsReleasesLock(t *testing.T) {
	f := start(t)
	c1 := f.dial(t)
	run(t, c1, DirectiveLockRequested, "")
	if n := f.agent.DropConnections(); n != 1 {
		t.Fatalf("dropped %d connections", n)
	}
	c2 := f.dial(t)
	order := make(chan string, 1)
	requestLock(t, c2, "c2", order)
	select {
	case <-order:
	case <-time.After(10 * time.Second):
		t.Fatal("lock of a dropped connection was not released")
	}
	if _, err := c1.NewSession(); err == nil {
		t.Fatal("dropped connection still usable")
	}
}

// BenchmarkAgentExecTrue is one `true` exec per iteration over one kept
// SSH connection (a new session channel each, as clients do).
func BenchmarkAgentExecTrue(b *testing.B) {
	f := start(b)
	c := f.dial(b)
	var took []time.Duration
	for b.Loop() {
		t0 := time.Now()
		if _, _, code := run(b, c, "true", ""); code != 0 {
			b.Fatal(code)
		}
		took = append(took, time.Since(t0))
	}
	slices.Sort(took)
	b.ReportMetric(float64(took[len(took)/2].Microseconds()), "p50-µs")
}

// BenchmarkAgentExecParallel8 runs `true` from 8 concurrent sessions, each
// on its own connection; ns/op is the inverse of the agent's throughput.
func BenchmarkAgentExecParallel8(b *testing.B) {
	f := start(b)
	clients := make(chan *ssh.Client, 8)
	for range 8 {
		clients <- f.dial(b)
	}
	b.SetParallelism(8) // 8×GOMAXPROCS goroutines share the 8 connections
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			c := <-clients
			if _, _, code := run(b, c, "true", ""); code != 0 {
				b.Error(code)
			}
			clients <- c
		}
	})
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "execs/s")
}

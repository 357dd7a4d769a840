package client_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/internal/testutil"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
	"github.com/sandboxd/sandboxd/ipc/ipctest"
	"github.com/sandboxd/sandboxd/ipc/server"
)

func start(t testing.TB) (*ipctest.Server, *client.Client) {
	t.Helper()
	s := ipctest.Start(t, ipctest.Options{Server: server.Options{Version: "test-7"}})
	c := client.New(s.Socket)
	t.Cleanup(c.Close)
	return s, c
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return c
}

func TestTypedCallsAndDaemonVersion(t *testing.T) {
	s, c := start(t)
	if c.DaemonVersion() != "" {
		t.Fatal("version known before any answer")
	}
	v, err := c.Version(ctx(t))
	if err != nil || v.Version != "test-7" {
		t.Fatalf("version %+v %v", v, err)
	}
	if c.DaemonVersion() != "test-7" {
		t.Fatalf("header version %q", c.DaemonVersion())
	}
	st, err := c.Start(ctx(t), ipc.StartRequest{Target: ipc.Target{Cwd: "/r"}, Init: map[string]string{"k": "v"}})
	if err != nil || !st.Created || st.Session.RunID != "run-1" {
		t.Fatalf("start %+v %v", st, err)
	}
	if _, err := c.List(ctx(t), ipc.ListRequest{All: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Status(ctx(t), ipc.StatusRequest{Cwd: "/r", ConfigFile: "x y.yml"}); err != nil {
		t.Fatal(err)
	}
	reqs := s.Sessions.Requests()
	if got := reqs[1].(ipc.ListRequest); !got.All {
		t.Errorf("list all not sent: %+v", got)
	}
	if got := reqs[2].(ipc.StatusRequest); got.ConfigFile != "x y.yml" || got.Cwd != "/r" {
		t.Errorf("status query: %+v", got)
	}
	for _, f := range []func() error{
		func() error { _, err := c.Health(ctx(t)); return err },
		func() error { _, err := c.Config(ctx(t)); return err },
		func() error {
			_, err := c.Reset(ctx(t), ipc.StartRequest{Target: ipc.Target{RunID: "run-1"}})
			return err
		},
		func() error { _, err := c.Stop(ctx(t), ipc.StopRequest{All: true}); return err },
		func() error { _, err := c.Init(ctx(t), ipc.InitRequest{Cwd: "/r"}); return err },
		func() error { _, err := c.Probe(ctx(t), "s1"); return err },
		func() error { return c.Reconcile(ctx(t)) },
		func() error { _, err := c.OpenAPI(ctx(t)); return err },
		func() error { return c.StopDaemon(ctx(t)) },
	} {
		if err := f(); err != nil {
			t.Error(err)
		}
	}
}

func TestErrorsKeepTheirKind(t *testing.T) {
	s, c := start(t)
	_, err := c.Probe(ctx(t), "nope")
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "no session nope") {
		t.Fatalf("probe of unknown session: %v", err)
	}
	var apiErr *client.APIError
	if !errors.As(err, &apiErr) || apiErr.Status != 404 {
		t.Fatalf("no APIError with status: %#v", err)
	}
	s.Sessions.StartFn = func(context.Context, ipc.StartRequest) (ipc.StartResponse, error) {
		return ipc.StartResponse{}, errdefs.Conflictf("a reset is running")
	}
	if _, err := c.Start(ctx(t), ipc.StartRequest{Target: ipc.Target{Cwd: "/r"}}); !errors.Is(err, errdefs.ErrConflict) || err.Error() != "a reset is running" {
		t.Fatalf("start conflict: %v", err)
	}
	if _, err := c.Start(ctx(t), ipc.StartRequest{Target: ipc.Target{Cwd: "rel"}}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("relative cwd: %v", err)
	}
}

func TestNotRunning(t *testing.T) {
	dir, err := os.MkdirTemp("", "nook")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	missing := client.New(filepath.Join(dir, "none.sock"))
	_, err = missing.Version(ctx(t))
	var nr *client.NotRunningError
	if !errors.As(err, &nr) || !errors.Is(err, client.ErrDaemonNotRunning) || !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("missing socket: %v", err)
	}
	// A stale socket: the file exists, nobody listens.
	stale := filepath.Join(dir, "stale.sock")
	ln, err := net.Listen("unix", stale)
	if err != nil {
		t.Fatal(err)
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	ln.Close()
	if _, err := client.New(stale).Health(ctx(t)); !errors.Is(err, client.ErrDaemonNotRunning) {
		t.Fatalf("stale socket: %v", err)
	}
	long := client.New("/" + strings.Repeat("x", 120))
	if _, err := long.Version(ctx(t)); !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "longer than") {
		t.Fatalf("long path: %v", err)
	}
}

func TestExecStdinEchoAndStreams(t *testing.T) {
	s, c := start(t)
	s.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		if err := st.Send(ipc.ExecOutput{Type: ipc.ExecStarted}); err != nil {
			return ipc.ExecResult{}, err
		}
		fmtErr := st.Send(ipc.ExecOutput{Type: ipc.ExecWarning, Message: "config drift: run nook reset"})
		if fmtErr != nil {
			return ipc.ExecResult{}, fmtErr
		}
		n, err := io.Copy(st.Stdout(), st.Stdin())
		if err != nil {
			return ipc.ExecResult{}, err
		}
		io.WriteString(st.Stderr(), "done\n")
		return ipc.ExecResult{RunID: "run-1", ExitCode: int(n % 256)}, nil
	}
	payload := bytes.Repeat([]byte("0123456789abcdef"), 100_000/16*4) // 400 kB: many frames
	var stdout, stderr bytes.Buffer
	var frames []string
	res, err := c.Exec(ctx(t), ipc.ExecRequest{Target: ipc.Target{Cwd: "/r"}, Argv: []string{"cat"}}, client.ExecOptions{
		Stdin: bytes.NewReader(payload), Stdout: &stdout, Stderr: &stderr,
		OnFrame: func(f ipc.ExecOutput) { frames = append(frames, f.Type+":"+f.Message) },
	})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(stdout.Bytes(), payload) {
		t.Fatalf("stdout: %d bytes, want the %d of stdin", stdout.Len(), len(payload))
	}
	if stderr.String() != "done\n" || res.ExitCode != len(payload)%256 || res.PulledFiles == nil {
		t.Fatalf("stderr %q result %+v", stderr.String(), res)
	}
	if strings.Join(frames, ",") != "started:,warning:config drift: run nook reset" {
		t.Fatalf("frames %v", frames)
	}
	if req := s.Sessions.Requests()[0].(ipc.ExecRequest); !req.Stdin || req.Argv[0] != "cat" {
		t.Fatalf("request %+v", req)
	}
}

func TestExecSignalsDelivered(t *testing.T) {
	s, c := start(t)
	s.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		io.WriteString(st.Stdout(), "ready\n")
		select {
		case sig := <-st.Signals():
			io.WriteString(st.Stdout(), "got "+sig+"\n")
			return ipc.ExecResult{ExitCode: 130, Signal: sig}, nil
		case <-ctx.Done():
			return ipc.ExecResult{}, ctx.Err()
		}
	}
	sigs := make(chan string, 1)
	stdout := &testutil.LockedBuffer{}
	// The signal is sent once the command said it is ready.
	go func() {
		for !strings.Contains(stdout.String(), "ready") {
			time.Sleep(time.Millisecond)
		}
		sigs <- "INT"
	}()
	res, err := c.Exec(ctx(t), ipc.ExecRequest{Target: ipc.Target{RunID: "run-1"}, Argv: []string{"sleep", "9"}}, client.ExecOptions{Stdout: stdout, Signals: sigs})
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 130 || res.Signal != "INT" || stdout.String() != "ready\ngot INT\n" {
		t.Fatalf("result %+v stdout %q", res, stdout.String())
	}
}

func TestExecDisconnectCancelsBackend(t *testing.T) {
	s, c := start(t)
	cancelled := make(chan error, 1)
	running := make(chan struct{})
	s.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		st.Send(ipc.ExecOutput{Type: ipc.ExecStarted})
		close(running)
		<-ctx.Done()
		cancelled <- context.Cause(ctx)
		return ipc.ExecResult{}, errdefs.Canceled(ctx.Err())
	}
	cctx, cancel := context.WithCancel(ctx(t))
	errc := make(chan error, 1)
	go func() {
		// Stdin from a pipe nobody closes: the body stays open.
		pr, _ := io.Pipe()
		_, err := c.Exec(cctx, ipc.ExecRequest{Target: ipc.Target{Cwd: "/r"}, Argv: []string{"sleep", "100"}}, client.ExecOptions{Stdin: pr})
		errc <- err
	}()
	<-running
	if s.API.ActiveStreams() != 1 {
		t.Errorf("active streams %d, want 1", s.API.ActiveStreams())
	}
	cancel()
	select {
	case cause := <-cancelled:
		if cause == nil {
			t.Fatal("no cause")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the backend's context was not cancelled when the client went away")
	}
	if err := <-errc; !errors.Is(err, errdefs.ErrCanceled) {
		t.Fatalf("client error %v, want canceled", err)
	}
	waitFor(t, func() bool { return s.API.ActiveStreams() == 0 && s.API.ActiveRequests() == 0 })
}

// An exec whose command ignores a stdin that never ends (a terminal) still
// returns when the command does.
func TestExecReturnsWithStdinStillOpen(t *testing.T) {
	s, c := start(t)
	s.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		io.WriteString(st.Stdout(), "hi\n")
		return ipc.ExecResult{ExitCode: 3}, nil
	}
	pr, pw := io.Pipe()
	defer pw.Close()
	var out bytes.Buffer
	res, err := c.Exec(ctx(t), ipc.ExecRequest{Target: ipc.Target{Cwd: "/r"}, Argv: []string{"echo"}}, client.ExecOptions{Stdin: pr, Stdout: &out})
	if err != nil || res.ExitCode != 3 || out.String() != "hi\n" {
		t.Fatalf("%+v %v %q", res, err, out.String())
	}
	waitFor(t, func() bool { return s.API.ActiveRequests() == 0 })
}

func TestExecErrors(t *testing.T) {
	s, c := start(t)
	s.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		switch req.Argv[0] {
		case "before":
			return ipc.ExecResult{}, errdefs.NotFoundf("no session for run nope")
		case "running":
			st.Send(ipc.ExecOutput{Type: ipc.ExecStarted})
			return ipc.ExecResult{}, errdefs.Unavailable(errors.New("the connection broke while the command ran"))
		default:
			st.Send(ipc.ExecOutput{Type: ipc.ExecQueued, Position: 2})
			io.WriteString(st.Stdout(), "partial")
			return ipc.ExecResult{}, errdefs.Unavailable(errors.New("the connection broke"))
		}
	}
	_, err := c.Exec(ctx(t), ipc.ExecRequest{Target: ipc.Target{RunID: "nope"}, Argv: []string{"before"}}, client.ExecOptions{})
	var apiErr *client.APIError
	if !errors.Is(err, errdefs.ErrNotFound) || !errors.As(err, &apiErr) || apiErr.Status != 404 || err.Error() != "no session for run nope" {
		t.Fatalf("error before the first frame: %v", err)
	}
	var out bytes.Buffer
	var pos int
	_, err = c.Exec(ctx(t), ipc.ExecRequest{Target: ipc.Target{RunID: "r"}, Argv: []string{"after"}}, client.ExecOptions{Stdout: &out, OnFrame: func(f ipc.ExecOutput) { pos = f.Position }})
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "connection broke (the command did not run, so it is safe to retry)") || out.String() != "partial" || pos != 2 {
		t.Fatalf("error after frames: %v, out %q, position %d", err, out.String(), pos)
	}
	// Once the command started, the daemon's own words say what may have
	// happened: nothing is added.
	_, err = c.Exec(ctx(t), ipc.ExecRequest{Target: ipc.Target{RunID: "r"}, Argv: []string{"running"}}, client.ExecOptions{})
	if !errors.Is(err, errdefs.ErrUnavailable) || strings.Contains(err.Error(), "did not run") {
		t.Fatalf("error after the command started: %v", err)
	}
	_, err = c.Exec(ctx(t), ipc.ExecRequest{Target: ipc.Target{Cwd: "/r"}}, client.ExecOptions{})
	if !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "argv is empty") {
		t.Fatalf("empty argv: %v", err)
	}
}

func TestEventsStreamSinceAndClose(t *testing.T) {
	s, c := start(t)
	for i := 0; i < 3; i++ {
		s.Events.Publish("session.created")
	}
	since := uint64(1)
	st, err := c.Events(ctx(t), &since)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for _, want := range []uint64{2, 3} {
		ev, err := st.Next()
		if err != nil || ev.Seq != want {
			t.Fatalf("replay: %+v %v, want seq %d", ev, err, want)
		}
	}
	waitFor(t, func() bool { return s.Events.Subscribers() == 1 })
	s.Events.Publish("exec.finished")
	if ev, err := st.Next(); err != nil || ev.Seq != 4 || ev.Type != "exec.finished" {
		t.Fatalf("live: %+v %v", ev, err)
	}
	s.Events.DropAll(errdefs.Unavailable(errors.New("slow consumer: you fell 1024 events behind")))
	_, err = st.Next()
	var closed *client.StreamClosedError
	if !errors.As(err, &closed) || !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(closed.Reason, "slow consumer") {
		t.Fatalf("drop: %v", err)
	}
	waitFor(t, func() bool { return s.API.ActiveStreams() == 0 })

	// A replay point that has left the buffer is refused.
	for i := 0; i < 20; i++ {
		s.Events.Publish("x")
	}
	zero := uint64(0)
	if _, err := c.Events(ctx(t), &zero); !errors.Is(err, errdefs.ErrGone) {
		t.Fatalf("since=0 after the buffer moved on: %v", err)
	}
}

func TestShutdownEndsEventStreamsAndWaitsForExec(t *testing.T) {
	s, c := start(t)
	release := make(chan struct{})
	running := make(chan struct{})
	s.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		st.Send(ipc.ExecOutput{Type: ipc.ExecStarted})
		close(running)
		<-release
		return ipc.ExecResult{ExitCode: 0}, nil
	}
	ev, err := c.Events(ctx(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Close()
	execDone := make(chan error, 1)
	go func() {
		_, err := c.Exec(ctx(t), ipc.ExecRequest{Target: ipc.Target{Cwd: "/r"}, Argv: []string{"slow"}}, client.ExecOptions{})
		execDone <- err
	}()
	<-running
	shutDone := make(chan error, 1)
	go func() {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		shutDone <- s.API.Shutdown(sctx)
	}()
	if _, err := ev.Next(); !strings.Contains(errString(err), "shutting down") {
		t.Fatalf("event stream at shutdown: %v", err)
	}
	select {
	case err := <-shutDone:
		t.Fatalf("shutdown returned (%v) while an exec was running", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	if err := <-execDone; err != nil {
		t.Fatalf("exec cut by shutdown: %v", err)
	}
	if err := <-shutDone; err != nil {
		t.Fatal(err)
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 5s")
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// Execs back to back on one client: none may start with a context that an
// earlier exec cancelled (each has a connection of its own, which the
// daemon sees closed after the earlier one's answer).
func TestExecsBackToBack(t *testing.T) {
	s, c := start(t)
	s.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		select {
		case <-ctx.Done():
			return ipc.ExecResult{}, fmt.Errorf("exec %s: cancelled before it ran: %w", req.Argv[0], ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
		_, _ = io.WriteString(st.Stdout(), "ok\n")
		return ipc.ExecResult{RunID: "run-1"}, nil
	}
	for i := range 40 {
		var out bytes.Buffer
		if _, err := c.Exec(ctx(t), ipc.ExecRequest{Target: ipc.Target{Cwd: "/r"}, Argv: []string{strconv.Itoa(i)}}, client.ExecOptions{Stdout: &out}); err != nil {
			t.Fatalf("exec %d: %v", i, err)
		}
	}
}

// failingStdin yields some bytes, then fails as a broken terminal does.
type failingStdin struct{ sent bool }

func (f *failingStdin) Read(p []byte) (int, error) {
	if !f.sent {
		f.sent = true
		return copy(p, "partial input\n"), nil
	}
	return 0, errors.New("read /dev/tty: input/output error")
}

// A stdin the client fails to read abandons the request stream: the daemon
// sees it broken (the command is cancelled), never a clean end of input on
// which the command would go on with half of it; the caller is told that
// reading stdin failed.
func TestExecStdinReadErrorAbandonsTheStream(t *testing.T) {
	s, c := start(t)
	seen := make(chan string, 1)
	s.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		in, _ := io.ReadAll(st.Stdin())
		// The input reader cancels the exec when the body breaks; give it
		// the moment it takes after the stdin channel closed.
		select {
		case <-ctx.Done():
			seen <- "cancelled after " + strconv.Quote(string(in))
			return ipc.ExecResult{}, errdefs.Canceled(context.Cause(ctx))
		case <-time.After(2 * time.Second):
			seen <- "a clean end of input after " + strconv.Quote(string(in))
			return ipc.ExecResult{ExitCode: 0}, nil
		}
	}
	_, err := c.Exec(ctx(t), ipc.ExecRequest{Target: ipc.Target{Cwd: "/r"}, Argv: []string{"cat"}}, client.ExecOptions{Stdin: &failingStdin{}})
	if err == nil || !strings.Contains(err.Error(), "read stdin to forward it") || !strings.Contains(err.Error(), "input/output error") {
		t.Fatalf("exec with a failing stdin: %v, want the stdin read error", err)
	}
	select {
	case got := <-seen:
		if !strings.HasPrefix(got, "cancelled") {
			t.Fatalf("the daemon saw %s", got)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the backend never ran or never ended")
	}
}

// endless is a stdin that never ends: the exec's upload is still being
// written when the daemon answers.
type endless struct{}

func (endless) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// TestExecRefusedBeforeReadingStdinGivesTheDaemonsAnswer: the daemon
// refuses an exec (not a checkout, no session) before it reads the stdin
// being uploaded, and closes the connection; the client still says the
// daemon's words, not that the daemon went away. Go's transport returns
// the upload's write error over an answer that came first, so the race is
// run many times.
func TestExecRefusedBeforeReadingStdinGivesTheDaemonsAnswer(t *testing.T) {
	s, c := start(t)
	s.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		return ipc.ExecResult{}, errdefs.Invalidf("%s is not inside a git repository", req.Target.Cwd)
	}
	for i := 0; i < 30; i++ {
		_, err := c.Exec(ctx(t), ipc.ExecRequest{Target: ipc.Target{Cwd: "/plain"}, Argv: []string{"true"}}, client.ExecOptions{Stdin: endless{}})
		if !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(errString(err), "not inside a git repository") {
			t.Fatalf("exec %d refused before its stdin was read: %v, want the daemon's answer", i+1, err)
		}
	}
}

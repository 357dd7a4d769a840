package sessions

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/daemon/forward"
	"github.com/sandboxd/sandboxd/daemon/gitsync"
	"github.com/sandboxd/sandboxd/daemon/runsapi"
	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/rwxapi"
	"github.com/sandboxd/sandboxd/store"
)

// fakeRemoteAPI is an HTTP runs API whose answers the test chooses; the
// manager reaches it through the real runsapi client, so status codes are
// mapped to error kinds exactly as in production.
type fakeRemoteAPI struct {
	srv *httptest.Server
	// listed are the run ids the bulk list answers.
	listed atomic.Pointer[[]string]
	// connInfo answers GET connection info: a status (0: block until the
	// request is cancelled), and a body for 2xx.
	connStatus atomic.Int64
	connCalls  atomic.Int64
	// release ends the blocked calls with a 503.
	release chan struct{}
}

func newFakeRemoteAPI(t *testing.T) *fakeRemoteAPI {
	t.Helper()
	f := &fakeRemoteAPI{release: make(chan struct{})}
	f.listed.Store(&[]string{})
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case rwxapi.PathRuns:
			var runs []map[string]string
			for _, id := range *f.listed.Load() {
				runs = append(runs, map[string]string{"id": id})
			}
			json.NewEncoder(w).Encode(map[string]any{"runs": runs})
		case rwxapi.PathConnectionInfo:
			f.connCalls.Add(1)
			status := int(f.connStatus.Load())
			if status == 0 {
				select {
				case <-r.Context().Done():
					return
				case <-f.release:
					status = http.StatusServiceUnavailable
				}
			}
			w.WriteHeader(status)
			if status/100 == 2 {
				json.NewEncoder(w).Encode(map[string]any{"sandboxable": false, "polling": map[string]any{"completed": false, "backoff_ms": 100}})
				return
			}
			json.NewEncoder(w).Encode(map[string]any{"error": http.StatusText(status)})
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(f.srv.Close)
	return f
}

type fakeSource struct{ r Remote }

func (f fakeSource) Remote(context.Context) (Remote, error) { return f.r, nil }
func (f fakeSource) Info() RemoteInfo                       { return RemoteInfo{Name: "test"} }

type nopPool struct{}

func (nopPool) NewLink(func(bool, error)) Link { return nopLink{} }

type nopLink struct{}

func (nopLink) Get(context.Context, sshpool.Target) (*sshpool.Conn, error) { return nil, nil }
func (nopLink) Ensure(sshpool.Target)                                      {}
func (nopLink) Forget()                                                    {}

type nopSync struct{}

func (nopSync) Prepare(context.Context, string, string) (*gitsync.Patch, error) { return nil, nil }
func (nopSync) PrepareExchange(context.Context, gitsync.Runner, string, string) (*gitsync.Patch, error) {
	return nil, nil
}
func (nopSync) Push(context.Context, gitsync.Runner, *gitsync.Patch) (gitsync.PushResult, error) {
	return gitsync.PushResult{}, nil
}
func (nopSync) Fuse(context.Context, gitsync.Runner, *gitsync.Patch, string) (*gitsync.Exchange, bool, error) {
	return nil, false, nil
}
func (nopSync) Pull(context.Context, gitsync.Runner, string) (gitsync.PullResult, error) {
	return gitsync.PullResult{}, nil
}
func (nopSync) Save(context.Context, gitsync.Runner, string) (gitsync.PullResult, error) {
	return gitsync.PullResult{}, nil
}
func (nopSync) Unpulled(context.Context, gitsync.Runner, string) ([]string, string, error) {
	return nil, "", nil
}

type nopEvents struct{}

func (nopEvents) Publish(typ, sessionID, runID string, data any) ipc.Event { return ipc.Event{} }

type fixedBranch struct{}

func (fixedBranch) Branch(string) (string, error) { return "main", nil }

// newTestManager is a manager on a real store, talking to api through the
// real runs API client with short timeouts and no retries.
func newTestManager(t *testing.T, api *fakeRemoteAPI, timeout time.Duration) (*Manager, *store.Store) {
	t.Helper()
	return newTestManagerWith(t, api, timeout, nopEvents{})
}

// newTestManagerWith is newTestManager publishing to ev.
func newTestManagerWith(t *testing.T, api *fakeRemoteAPI, timeout time.Duration, ev Publisher) (*Manager, *store.Store) {
	t.Helper()
	st, err := store.Open(context.Background(), filepath.Join(t.TempDir(), "sandboxd.db"), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	client, err := runsapi.New(runsapi.Options{BaseURL: api.srv.URL, Token: "tok", Timeout: timeout, MaxRetries: -1})
	if err != nil {
		t.Fatal(err)
	}
	m, err := New(Options{Store: st, Remotes: fakeSource{client}, Pool: nopPool{}, Sync: nopSync{}, Events: ev, Branches: fixedBranch{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		m.Close(ctx)
	})
	return m, st
}

func insertSession(t *testing.T, st *store.Store, runID string, state store.State) *store.Session {
	t.Helper()
	s := &store.Session{
		Identity: store.Identity{RepoRoot: "/src/" + runID, Branch: "main", ConfigFile: "/src/" + runID + "/.rwx/sandbox.yml"},
		Remote:   "test", RunID: runID, IdempotencyKey: "key-" + runID, State: state,
		Address: "127.0.0.1:1", PublicHostKey: "host", PrivateUserKey: "user",
	}
	if err := st.Insert(s); err != nil {
		t.Fatal(err)
	}
	return s
}

// TestReconcileTransientCheckKeepsSession: the bulk list succeeds without a
// ready session, and the session's own check then fails transiently (a 503,
// then no answer within the timeout): the session is kept and marked
// unknown with the reason, never expired. Only the remote's definite 404
// ends it.
func TestReconcileTransientCheckKeepsSession(t *testing.T) {
	api := newFakeRemoteAPI(t)
	m, st := newTestManager(t, api, 300*time.Millisecond)
	s := insertSession(t, st, "run-transient", store.StateReady)

	for _, c := range []struct {
		name   string
		status int
		reason string
	}{
		{"503", http.StatusServiceUnavailable, "503"},
		{"502", http.StatusBadGateway, "502"},
		{"timeout", 0, "no answer within"},
	} {
		api.connStatus.Store(int64(c.status))
		before := api.connCalls.Load()
		rep, err := m.ReconcileNow(context.Background())
		if err != nil {
			t.Fatalf("%s: reconcile: %v", c.name, err)
		}
		if api.connCalls.Load() == before {
			t.Fatalf("%s: the session missing from the list was not checked on its own", c.name)
		}
		if rep.Expired != 0 || rep.Unknown != 1 || rep.Checked != 1 {
			t.Fatalf("%s: report %+v, want 1 checked, 1 unknown, 0 expired", c.name, rep)
		}
		got, err := st.Get(s.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.State != store.StateUnknown || !strings.Contains(got.StateReason, c.reason) {
			t.Fatalf("%s: session is %s (%q), want unknown with the cause", c.name, got.State, got.StateReason)
		}
	}

	// The remote's definite word ends it.
	api.connStatus.Store(http.StatusNotFound)
	rep, err := m.ReconcileNow(context.Background())
	if err != nil || rep.Expired != 1 {
		t.Fatalf("404: report %+v, %v: want 1 expired", rep, err)
	}
	if got, _ := st.Get(s.ID); got.State != store.StateExpired {
		t.Fatalf("after a 404 the session is %s, want expired", got.State)
	}
}

// recordingForwards records the forwards opened.
type recordingForwards struct {
	mu     sync.Mutex
	opened []forward.Spec
}

func (f *recordingForwards) Open(spec forward.Spec) (forward.Info, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.opened = append(f.opened, spec)
	return forward.Info{Spec: spec}, nil
}
func (f *recordingForwards) NewSet() ForwardSet              { return f }
func (f *recordingForwards) Close(string) bool               { return false }
func (f *recordingForwards) CloseAll() []forward.Info        { return nil }
func (f *recordingForwards) Get(string) (forward.Info, bool) { return forward.Info{}, false }

// TestRehydrateReopensForwardsFirst: Rehydrate reopens the port forwards of
// the live sessions before it returns, while the remote has answered none
// of their checks (the daemon reports READY right after it: the checks of a
// thousand sessions must not compete with that start); an ended session's
// forward stays closed.
func TestRehydrateReopensForwardsFirst(t *testing.T) {
	api := newFakeRemoteAPI(t)
	api.connStatus.Store(0) // hang until released
	defer close(api.release)
	fw := &recordingForwards{}
	m, st := newTestManager(t, api, time.Minute)
	m.opts.Forwards = fw
	web := store.Background{Name: "web", TargetPort: 8080, LocalPort: 18080, Forwarding: true}
	for _, s := range []*store.Session{insertSession(t, st, "run-live", store.StateReady), insertSession(t, st, "run-ended", store.StateStopped)} {
		if _, err := st.Update(s.ID, func(s *store.Session) error { s.Background = []store.Background{web}; return nil }); err != nil {
			t.Fatal(err)
		}
	}

	m.Rehydrate(context.Background())
	fw.mu.Lock()
	defer fw.mu.Unlock()
	want := []forward.Spec{{RunID: "run-live", Name: "web", TargetPort: 8080, LocalPort: 18080}}
	if !reflect.DeepEqual(fw.opened, want) {
		t.Fatalf("forwards opened by Rehydrate: %+v, want %+v", fw.opened, want)
	}
}

// TestRehydrateNeverWaitsForTheRemote: with a remote that does not answer
// (the client would wait a minute), Rehydrate returns at once (the daemon
// reports READY right after it) and the stored session is left as it is;
// its check runs in the background and, when the remote finally answers
// 503, keeps the session as unknown.
func TestRehydrateNeverWaitsForTheRemote(t *testing.T) {
	api := newFakeRemoteAPI(t)
	api.connStatus.Store(0) // hang until released
	m, st := newTestManager(t, api, time.Minute)
	s := insertSession(t, st, "run-hang", store.StateReady)

	done := make(chan struct{})
	go func() {
		m.Rehydrate(context.Background())
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		close(api.release)
		t.Fatal("Rehydrate waited for the remote")
	}
	if got, _ := st.Get(s.ID); got.State != store.StateReady {
		t.Fatalf("the session changed before its check could finish: %s", got.State)
	}
	close(api.release)
	deadline := time.Now().Add(20 * time.Second)
	for {
		got, _ := st.Get(s.ID)
		if got.State == store.StateUnknown {
			break
		}
		if got.State.Terminal() || time.Now().After(deadline) {
			t.Fatalf("after a rehydration check answered 503 the session is %s (%q)", got.State, got.StateReason)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// recordingEvents records the types of the events published.
type recordingEvents struct {
	mu    sync.Mutex
	types []string
}

func (e *recordingEvents) Publish(typ, sessionID, runID string, data any) ipc.Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.types = append(e.types, typ)
	return ipc.Event{}
}

// TestASessionEndsOnceWhenAStopAndAnExpiryRace: a stop ends the session
// while an expiry, which read the session before the stop, ends it too
// (the stop's end of the run drops the connection; the reconnect asks the
// remote, which says the run is over). The session stays stopped and only
// session.stopped is published: a client following the events (the
// Neovim statusline) would otherwise show "expired" after the user's stop.
func TestASessionEndsOnceWhenAStopAndAnExpiryRace(t *testing.T) {
	ev := &recordingEvents{}
	m, st := newTestManagerWith(t, newFakeRemoteAPI(t), 300*time.Millisecond, ev)
	s := insertSession(t, st, "run-raced", store.StateReady)
	stale := *s
	m.end(s, store.StateStopped, "stopped by the user", eventSessionStopped)
	m.expire(&stale, "the run is over")

	if got, _ := st.Get(s.ID); got.State != store.StateStopped {
		t.Fatalf("the session is %s after the stop and a late expiry, want stopped", got.State)
	}
	ev.mu.Lock()
	defer ev.mu.Unlock()
	if len(ev.types) != 1 || ev.types[0] != eventSessionStopped {
		t.Fatalf("events published: %v, want only %s", ev.types, eventSessionStopped)
	}
}

// TestAStoppingSessionIsNotExpiredByItsReconnect: while a stop ends the
// run, the connection it drops reconnects and asks whether the run is
// alive; the remote already says it is over. The session is left to the
// stop (it ends stopped, not expired) and the pool is told to wait.
func TestAStoppingSessionIsNotExpiredByItsReconnect(t *testing.T) {
	api := newFakeRemoteAPI(t)
	m, st := newTestManager(t, api, 300*time.Millisecond)
	s := insertSession(t, st, "run-stopping", store.StateReady)
	api.connStatus.Store(http.StatusNotFound)

	m.setStopping(s.ID, true)
	err := m.CheckAlive(context.Background(), s.RunID)
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("CheckAlive during the stop: %v, want unavailable", err)
	}
	if got, _ := st.Get(s.ID); got.State != store.StateReady {
		t.Fatalf("the session is %s during its stop, want it left to the stop (ready)", got.State)
	}
	m.setStopping(s.ID, false)
	if err := m.CheckAlive(context.Background(), s.RunID); !errors.Is(err, errdefs.ErrGone) {
		t.Fatalf("CheckAlive after a failed stop: %v, want gone (the remote's 404)", err)
	}
}

package store

import (
	"errors"
	"fmt"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
)

func TestInsertGetAndIndices(t *testing.T) {
	s, clock := newTestStore(t)

	a := &Session{Identity: ident("main"), Remote: "local", IdempotencyKey: "k1"}
	must(t, s.Insert(a))
	if a.ID == "" || a.State != StateCreating || !a.CreatedAt.Equal(clock.Now()) || !a.UpdatedAt.Equal(clock.Now()) {
		t.Fatalf("Insert did not fill id/state/times: %+v", a)
	}
	got, err := s.Get(a.ID)
	must(t, err)
	if !reflect.DeepEqual(*got, *a) {
		t.Fatalf("Get = %+v, want %+v", got, a)
	}
	if got, err := s.ByIdentity(ident("main")); err != nil || got.ID != a.ID {
		t.Fatalf("ByIdentity = %v, %v", got, err)
	}

	for name, err := range map[string]error{
		"Get":        second(s.Get("nope")),
		"ByIdentity": second(s.ByIdentity(ident("other"))),
		"ByRunID":    second(s.ByRunID("run-x")),
		"Delete":     s.Delete("nope"),
		"Update":     second(s.Update("nope", func(*Session) error { return nil })),
	} {
		if !errors.Is(err, ErrNotFound) || !errors.Is(err, errdefs.ErrNotFound) || errdefs.KindOf(err) != errdefs.KindNotFound {
			t.Errorf("%s: err = %v, want ErrNotFound of kind not_found", name, err)
		}
	}

	// The run id becomes known later: indexed by Update.
	clock.Advance(time.Second)
	up, err := s.Update(a.ID, func(x *Session) error { x.RunID, x.State = "run-1", StateProvisioning; return nil })
	must(t, err)
	if !up.UpdatedAt.Equal(clock.Now()) || !up.CreatedAt.Equal(a.CreatedAt) {
		t.Fatalf("Update times: %+v", up)
	}
	if got, err := s.ByRunID("run-1"); err != nil || got.ID != a.ID {
		t.Fatalf("ByRunID = %v, %v", got, err)
	}
	mustVerify(t, s)

	// A second live session for the identity, or for the run, is refused
	// with the existing one.
	for _, dup := range []*Session{
		{Identity: ident("main")},
		{Identity: ident("feature"), RunID: "run-1"},
		{ID: a.ID, Identity: ident("other")},
	} {
		err := s.Insert(dup)
		var exists *ExistsError
		if !errors.As(err, &exists) || exists.Existing.ID != a.ID || !errors.Is(err, ErrExists) || !errors.Is(err, errdefs.ErrConflict) || errdefs.KindOf(err) != errdefs.KindConflict {
			t.Fatalf("Insert(%+v): err = %v, want ExistsError with %s", dup, err, a.ID)
		}
		if dup.ID != "" && dup.ID != a.ID {
			t.Fatalf("failed Insert changed its argument: %+v", dup)
		}
	}

	// Changing the run id moves its index entry.
	_, err = s.Update(a.ID, func(x *Session) error { x.RunID = "run-2"; return nil })
	must(t, err)
	if _, err := s.ByRunID("run-1"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("old run id still indexed: %v", err)
	}
	mustVerify(t, s)

	// Changing the identity (ancestry adoption re-keys a detached session)
	// moves its index entry.
	_, err = s.Update(a.ID, func(x *Session) error { x.Branch = "detached@abc"; return nil })
	must(t, err)
	if _, err := s.ByIdentity(ident("main")); !errors.Is(err, ErrNotFound) {
		t.Fatalf("old identity still indexed: %v", err)
	}
	_, err = s.Update(a.ID, func(x *Session) error { x.Branch = "main"; return nil })
	must(t, err)
	mustVerify(t, s)

	// An Update cannot take another live session's identity or run id.
	b := &Session{Identity: ident("feature"), RunID: "run-3", State: StateReady}
	must(t, s.Insert(b))
	for _, fn := range []func(*Session) error{
		func(x *Session) error { x.Branch = "main"; return nil },
		func(x *Session) error { x.RunID = "run-2"; return nil },
	} {
		if _, err := s.Update(b.ID, fn); !errors.Is(err, ErrExists) {
			t.Fatalf("colliding Update: err = %v, want ErrExists", err)
		}
	}
	if got, _ := s.Get(b.ID); got.Branch != "feature" || got.RunID != "run-3" {
		t.Fatalf("a refused Update changed the record: %+v", got)
	}

	// fn's error aborts the transaction and comes back unchanged.
	boom := errors.New("boom")
	if _, err := s.Update(b.ID, func(x *Session) error { x.ExecCount = 99; return boom }); err != boom {
		t.Fatalf("err = %v, want boom", err)
	}
	if _, err := s.Update(b.ID, func(x *Session) error { x.ID = "other"; return nil }); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("changing the id: err = %v", err)
	}
	if _, err := s.Update(b.ID, func(x *Session) error { x.State = "bogus"; return nil }); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("unknown state: err = %v", err)
	}
	if got, _ := s.Get(b.ID); got.ExecCount != 0 {
		t.Fatalf("an aborted Update was stored: %+v", got)
	}
	mustVerify(t, s)
}

func second[T any](_ T, err error) error { return err }

func TestTerminalSessionsAreHistory(t *testing.T) {
	s, clock := newTestStore(t)
	a := &Session{Identity: ident("main"), RunID: "run-1", State: StateReady}
	must(t, s.Insert(a))

	clock.Advance(time.Minute)
	ended, err := s.Update(a.ID, func(x *Session) error { x.State, x.StateReason = StateStopped, "stopped by user"; return nil })
	must(t, err)
	if !ended.EndedAt.Equal(clock.Now()) {
		t.Fatalf("EndedAt = %v, want %v", ended.EndedAt, clock.Now())
	}
	if _, err := s.ByIdentity(ident("main")); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a terminal session is still the identity's session: %v", err)
	}
	if got, err := s.ByRunID("run-1"); err != nil || got.ID != a.ID {
		t.Fatalf("history must stay findable by run id: %v, %v", got, err)
	}
	mustVerify(t, s)

	// The identity is free for a new session; the old one is history.
	clock.Advance(time.Minute)
	b := &Session{Identity: ident("main"), RunID: "run-2"}
	must(t, s.Insert(b))
	if got, _ := s.ByIdentity(ident("main")); got.ID != b.ID {
		t.Fatalf("ByIdentity = %s, want %s", got.ID, b.ID)
	}
	// Updating the old session (still terminal) must not steal the entry.
	_, err = s.Update(a.ID, func(x *Session) error { x.StateReason = "run ended"; return nil })
	must(t, err)
	if got, _ := s.ByIdentity(ident("main")); got.ID != b.ID {
		t.Fatalf("ByIdentity = %s after updating history, want %s", got.ID, b.ID)
	}
	// Reviving the old one while b is live is refused.
	if _, err := s.Update(a.ID, func(x *Session) error { x.State = StateUnknown; return nil }); !errors.Is(err, ErrExists) {
		t.Fatalf("revival over a live session: err = %v", err)
	}
	mustVerify(t, s)

	// A session without identity (attached by run id) is not indexed by it.
	c := &Session{RunID: "run-3", State: StateReady}
	d := &Session{RunID: "run-4", State: StateReady}
	clock.Advance(time.Second)
	must(t, s.Insert(c))
	clock.Advance(time.Second)
	must(t, s.Insert(d))
	mustVerify(t, s)

	all, err := s.List()
	must(t, err)
	if len(all) != 4 || all[0].ID != a.ID || all[1].ID != b.ID {
		t.Fatalf("List not sorted by creation: %v", ids(all))
	}
	if n, _ := s.Count(); n != 4 {
		t.Fatalf("Count = %d", n)
	}

	// Only terminal sessions that ended before the cutoff are pruned.
	clock.Advance(time.Hour)
	must(t, second(s.Update(c.ID, func(x *Session) error { x.State = StateExpired; return nil })))
	n, err := s.PruneHistory(clock.Now().Add(-time.Minute))
	must(t, err)
	if n != 1 {
		t.Fatalf("PruneHistory = %d, want 1", n)
	}
	if _, err := s.Get(a.ID); !errors.Is(err, ErrNotFound) {
		t.Fatal("the old ended session was not pruned")
	}
	if _, err := s.ByRunID("run-1"); !errors.Is(err, ErrNotFound) {
		t.Fatal("a pruned session's run id is still indexed")
	}
	for _, id := range []string{b.ID, c.ID, d.ID} {
		must(t, second(s.Get(id)))
	}
	must(t, s.Delete(b.ID))
	if _, err := s.ByIdentity(ident("main")); !errors.Is(err, ErrNotFound) {
		t.Fatal("a deleted session is still indexed")
	}
	mustVerify(t, s)
}

func ids(ss []*Session) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = s.ID
	}
	return out
}

func TestInjectedIDs(t *testing.T) {
	dir := isolate(t)
	path := dir + "/s.db"
	n := 0
	s, err := Open(t.Context(), path, Options{NewID: func() (string, error) { n++; return fmt.Sprint("id-", n), nil }})
	must(t, err)
	defer s.Close()
	x := &Session{Identity: ident("main")}
	must(t, s.Insert(x))
	if x.ID != "id-1" {
		t.Fatalf("ID = %q", x.ID)
	}
	failing, err := Open(t.Context(), dir+"/f.db", Options{NewID: func() (string, error) { return "", errors.New("no entropy") }})
	must(t, err)
	defer failing.Close()
	if err := failing.Insert(&Session{}); err == nil {
		t.Fatal("Insert with a failing id generator succeeded")
	}
}

// Many creators of one identity at once: exactly one Insert wins and every
// other gets the winner; then many updaters of it lose no increment.
func TestConcurrentWritersOneIdentity(t *testing.T) {
	s, _ := newTestStore(t)
	const n = 32
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		winners []string
		seen    = map[string]int{}
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sess := &Session{Identity: ident("main"), RunID: fmt.Sprint("run-", i), IdempotencyKey: fmt.Sprint(i)}
			err := s.Insert(sess)
			mu.Lock()
			defer mu.Unlock()
			var exists *ExistsError
			switch {
			case err == nil:
				winners = append(winners, sess.ID)
			case errors.As(err, &exists):
				seen[exists.Existing.ID]++
			default:
				t.Errorf("Insert: %v", err)
			}
		}()
	}
	wg.Wait()
	if len(winners) != 1 || len(seen) != 1 || seen[winners[0]] != n-1 {
		t.Fatalf("winners %v, losers saw %v", winners, seen)
	}
	winner := winners[0]

	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := s.Update(winner, func(x *Session) error { x.ExecCount++; return nil }); err != nil {
				t.Errorf("Update: %v", err)
			}
		}()
	}
	wg.Wait()
	if got, _ := s.Get(winner); got.ExecCount != n {
		t.Fatalf("ExecCount = %d, want %d", got.ExecCount, n)
	}

	// Stop-and-replace races (nook reset from many callers): each one ends
	// the identity's live session if any and inserts a new one. At the end
	// exactly one session is live and the indices agree.
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if cur, err := s.ByIdentity(ident("main")); err == nil {
				_, _ = s.Update(cur.ID, func(x *Session) error { x.State = StateStopped; return nil })
			}
			err := s.Insert(&Session{Identity: ident("main"), RunID: fmt.Sprint("reset-", i)})
			if err != nil && !errors.Is(err, ErrExists) {
				t.Errorf("Insert: %v", err)
			}
		}()
	}
	wg.Wait()
	all, err := s.List()
	must(t, err)
	live := 0
	for _, x := range all {
		if !x.State.Terminal() {
			live++
		}
	}
	if live != 1 {
		t.Fatalf("%d live sessions for one identity", live)
	}
	mustVerify(t, s)
}

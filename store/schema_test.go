package store

import (
	"encoding/json"
	"errors"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
)

// writeV0 builds a schema-v0 file with raw bbolt: a sessions bucket only.
func writeV0(t *testing.T, path string, sessions []*Session) {
	t.Helper()
	db, err := bolt.Open(path, 0o600, nil)
	must(t, err)
	defer db.Close()
	must(t, db.Update(func(tx *bolt.Tx) error {
		b, err := tx.CreateBucket(bucketSessions)
		if err != nil {
			return err
		}
		for _, s := range sessions {
			data, err := json.Marshal(s)
			if err != nil {
				return err
			}
			if err := b.Put([]byte(s.ID), data); err != nil {
				return err
			}
		}
		return nil
	}))
}

func TestMigrateV0Fixture(t *testing.T) {
	path := filepath.Join(isolate(t), "sandboxd.db")
	t0 := time.Date(2024, 6, 1, 0, 0, 0, 0, time.UTC)
	at := func(m int) time.Time { return t0.Add(time.Duration(m) * time.Minute) }
	fixture := []*Session{
		{ID: "live-main", Identity: ident("main"), RunID: "run-1", State: StateReady, CreatedAt: at(1), Token: "tok-1"},
		{ID: "live-feature", Identity: ident("feature"), RunID: "run-2", State: StateProvisioning, CreatedAt: at(2)},
		{ID: "creating", Identity: ident("wip"), State: StateCreating, CreatedAt: at(3)},
		{ID: "ended-main", Identity: ident("main"), RunID: "run-0", State: StateStopped, CreatedAt: at(0), EndedAt: at(1)},
		{ID: "by-run-only", RunID: "run-3", State: StateUnknown, CreatedAt: at(4)},
		// v0 could hold two live sessions for one identity: the newer one
		// keeps the index, the older becomes history.
		{ID: "dup-old", Identity: ident("dup"), RunID: "run-5", State: StateReady, CreatedAt: at(5)},
		{ID: "dup-new", Identity: ident("dup"), RunID: "run-6", State: StateReady, CreatedAt: at(6)},
	}
	writeV0(t, path, fixture)

	clock := newFakeClock()
	s := openTest(t, path, clock)
	if v, err := s.schemaVersion(); err != nil || v != 1 {
		t.Fatalf("schema version after migration = %d, %v", v, err)
	}
	mustVerify(t, s)

	all, err := s.List()
	must(t, err)
	if len(all) != len(fixture) {
		t.Fatalf("%d sessions after migration, want %d", len(all), len(fixture))
	}
	for _, want := range fixture {
		got, err := s.Get(want.ID)
		must(t, err)
		if want.ID == "dup-old" {
			if got.State != StateExpired || !got.EndedAt.Equal(clock.Now()) || got.StateReason == "" {
				t.Errorf("superseded duplicate not made history: %+v", got)
			}
			continue
		}
		if !reflect.DeepEqual(*got, *want) {
			t.Errorf("session %s changed by the migration:\n got %+v\nwant %+v", want.ID, got, want)
		}
		if want.RunID != "" {
			if r, err := s.ByRunID(want.RunID); err != nil || r.ID != want.ID {
				t.Errorf("ByRunID(%s) = %v, %v", want.RunID, r, err)
			}
		}
	}
	for branch, wantID := range map[string]string{"main": "live-main", "feature": "live-feature", "wip": "creating", "dup": "dup-new"} {
		if got, err := s.ByIdentity(ident(branch)); err != nil || got.ID != wantID {
			t.Errorf("ByIdentity(%s) = %v, %v; want %s", branch, got, err, wantID)
		}
	}
	// Indices hold exactly the expected entries.
	must(t, s.view(func(tx *txn) error {
		if n := tx.byIdentity.Stats().KeyN; n != 4 {
			t.Errorf("by_identity has %d entries, want 4", n)
		}
		if n := tx.byRun.Stats().KeyN; n != 6 {
			t.Errorf("by_run has %d entries, want 6", n)
		}
		return nil
	}))
	// The store works normally afterwards.
	must(t, s.Insert(&Session{Identity: ident("next")}))
	mustVerify(t, s)
}

func TestMigrationOfUnreadableV0RecordLeavesFileUntouched(t *testing.T) {
	path := filepath.Join(isolate(t), "sandboxd.db")
	writeV0(t, path, []*Session{{ID: "ok", Identity: ident("main")}})
	db, err := bolt.Open(path, 0o600, nil)
	must(t, err)
	must(t, db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketSessions).Put([]byte("bad"), []byte("{")) }))
	must(t, db.Close())

	_, err = Open(t.Context(), path, Options{})
	if !errors.Is(err, ErrCorrupt) {
		t.Fatalf("err = %v, want ErrCorrupt", err)
	}
	// Still v0: no bucket was created, no version stamped.
	db, err = bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true})
	must(t, err)
	defer db.Close()
	must(t, db.View(func(tx *bolt.Tx) error {
		if tx.Bucket(bucketMeta) != nil || tx.Bucket(bucketByRun) != nil {
			t.Error("a failed migration left v1 buckets behind")
		}
		return nil
	}))
}

func TestMigrationsAreContiguous(t *testing.T) {
	ms := migrations()
	if len(ms) != CurrentSchemaVersion {
		t.Fatalf("%d migrations for schema version %d", len(ms), CurrentSchemaVersion)
	}
	for i, m := range ms {
		if m.from != i {
			t.Fatalf("migration %d starts at version %d", i, m.from)
		}
	}
}

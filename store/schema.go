package store

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"time"

	bolt "go.etcd.io/bbolt"
)

// Bucket names and meta keys of the on-disk layout.
var (
	bucketMeta          = []byte("meta")
	bucketSessions      = []byte("sessions")       // id → JSON Session
	bucketByIdentity    = []byte("by_identity")    // Identity.Key() → id, live sessions only
	bucketByRun         = []byte("by_run")         // run id → id
	bucketLegacyImports = []byte("legacy_imports") // repo root → JSON; no longer written: the RWX CLI file is read on every change
	keySchemaVersion    = []byte("schema_version") // decimal ASCII
)

// CurrentSchemaVersion is the layout this build writes.
//
//   - v0: a "sessions" bucket only (id → JSON Session); no meta, no indices.
//     An empty file is v0 with no sessions.
//   - v1: adds "meta" (schema_version), "by_identity", "by_run" and
//     "legacy_imports".
const CurrentSchemaVersion = 1

// migration moves the layout from version from to from+1. It runs inside
// one read-write transaction together with the version stamp, so a crash
// leaves the file at either version, never between.
type migration struct {
	from  int
	name  string
	apply func(s *Store, tx *bolt.Tx) error
}

// migrations are in order; migrations()[i].from == i.
func migrations() []migration {
	return []migration{
		{from: 0, name: "build indices and meta", apply: migrateV0toV1},
	}
}

// schemaVersion reads the version; a file without a meta bucket is v0.
func (s *Store) schemaVersion() (int, error) {
	var version int
	err := s.db.View(func(tx *bolt.Tx) error {
		meta := tx.Bucket(bucketMeta)
		if meta == nil {
			// v0 has only the sessions bucket: anything else means this is
			// not a sandboxd store.
			return tx.ForEach(func(name []byte, _ *bolt.Bucket) error {
				if string(name) != string(bucketSessions) {
					return &CorruptError{Path: s.path, Err: fmt.Errorf("not a sandboxd store: no meta bucket and an unknown bucket %q", name)}
				}
				return nil
			})
		}
		raw := meta.Get(keySchemaVersion)
		v, err := strconv.Atoi(string(raw))
		if err != nil || v < 1 {
			return &CorruptError{Path: s.path, Err: fmt.Errorf("invalid schema version %q", raw)}
		}
		version = v
		return nil
	})
	return version, err
}

func (s *Store) migrate(ctx context.Context, from int) error {
	// A brand-new file is "v0 without a sessions bucket": creating it is
	// not worth a migration log line.
	created := false
	if from == 0 {
		_ = s.db.View(func(tx *bolt.Tx) error { created = tx.Bucket(bucketSessions) == nil; return nil })
	}
	for _, m := range migrations()[from:] {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("migrate store %s: %w", s.path, err)
		}
		start := time.Now()
		err := s.db.Update(func(tx *bolt.Tx) error {
			if err := m.apply(s, tx); err != nil {
				return err
			}
			meta, err := tx.CreateBucketIfNotExists(bucketMeta)
			if err != nil {
				return err
			}
			return meta.Put(keySchemaVersion, []byte(strconv.Itoa(m.from+1)))
		})
		if err != nil {
			return fmt.Errorf("migrate store %s from schema %d to %d (%s); the file is unchanged: %w", s.path, m.from, m.from+1, m.name, err)
		}
		if !created {
			s.log.Info("migrated store", "path", s.path, "from", m.from, "to", m.from+1, "step", m.name, "took", time.Since(start))
		}
	}
	return nil
}

// migrateV0toV1 creates the v1 buckets and builds both indices from the
// sessions. When v0 holds two live sessions for one identity (or two
// sessions for one run id), the most recently created keeps the index and
// the others are marked expired with a reason, so the invariant "a live
// identity has one session" holds afterwards and no record is lost.
func migrateV0toV1(s *Store, tx *bolt.Tx) error {
	for _, name := range [][]byte{bucketSessions, bucketByIdentity, bucketByRun, bucketLegacyImports} {
		if _, err := tx.CreateBucketIfNotExists(name); err != nil {
			return fmt.Errorf("create bucket %s: %w", name, err)
		}
	}
	t := newTxn(tx)
	var all []*Session
	err := t.sessions.ForEach(func(k, v []byte) error {
		sess, err := decodeSession(s.path, k, v)
		if err != nil {
			return err
		}
		all = append(all, sess)
		return nil
	})
	if err != nil {
		return err
	}
	// Newest first: it wins any collision.
	slices.SortFunc(all, func(a, b *Session) int { return -compareCreated(a, b) })
	now := s.now().UTC()
	for _, sess := range all {
		var superseded string
		if sess.RunID != "" {
			if id := t.byRun.Get([]byte(sess.RunID)); id != nil {
				superseded = string(id)
			} else if err := t.byRun.Put([]byte(sess.RunID), []byte(sess.ID)); err != nil {
				return err
			}
		}
		if superseded == "" && indexesIdentity(sess) {
			key := []byte(sess.Key())
			if id := t.byIdentity.Get(key); id != nil {
				superseded = string(id)
			} else if err := t.byIdentity.Put(key, []byte(sess.ID)); err != nil {
				return err
			}
		}
		if superseded == "" {
			continue
		}
		s.log.Warn("schema migration: session superseded by a newer one for the same identity or run", "session", sess.ID, "by", superseded)
		if !sess.State.Terminal() {
			sess.State = StateExpired
			sess.EndedAt = now
		}
		sess.StateReason = fmt.Sprintf("superseded by session %s during schema migration v0→v1", superseded)
		sess.UpdatedAt = now
		if err := t.put(sess); err != nil {
			return err
		}
	}
	return nil
}

// txn bundles the v1 buckets of one transaction.
type txn struct {
	tx         *bolt.Tx
	path       string
	sessions   *bolt.Bucket
	byIdentity *bolt.Bucket
	byRun      *bolt.Bucket
	legacy     *bolt.Bucket
}

func newTxn(tx *bolt.Tx) *txn {
	return &txn{
		tx:         tx,
		path:       tx.DB().Path(),
		sessions:   tx.Bucket(bucketSessions),
		byIdentity: tx.Bucket(bucketByIdentity),
		byRun:      tx.Bucket(bucketByRun),
		legacy:     tx.Bucket(bucketLegacyImports),
	}
}

func (t *txn) complete() bool {
	return t.sessions != nil && t.byIdentity != nil && t.byRun != nil && t.legacy != nil && t.tx.Bucket(bucketMeta) != nil
}

func (s *Store) view(fn func(t *txn) error) error {
	return s.db.View(func(tx *bolt.Tx) error {
		t := newTxn(tx)
		if !t.complete() {
			return &CorruptError{Path: s.path, Err: fmt.Errorf("a bucket of schema version %d is missing", CurrentSchemaVersion)}
		}
		return fn(t)
	})
}

func (s *Store) update(fn func(t *txn) error) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		t := newTxn(tx)
		if !t.complete() {
			return &CorruptError{Path: s.path, Err: fmt.Errorf("a bucket of schema version %d is missing", CurrentSchemaVersion)}
		}
		return fn(t)
	})
}

func decodeSession(path string, key, val []byte) (*Session, error) {
	var sess Session
	if err := json.Unmarshal(val, &sess); err != nil {
		return nil, &CorruptError{Path: path, Err: fmt.Errorf("session record %q: %w", key, err)}
	}
	if sess.ID != string(key) {
		return nil, &CorruptError{Path: path, Err: fmt.Errorf("session record %q holds id %q", key, sess.ID)}
	}
	return &sess, nil
}

func compareCreated(a, b *Session) int {
	if c := a.CreatedAt.Compare(b.CreatedAt); c != 0 {
		return c
	}
	switch {
	case a.ID < b.ID:
		return -1
	case a.ID > b.ID:
		return 1
	}
	return 0
}

package store

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
)

// indexesIdentity reports whether sess owns an entry in by_identity: only
// live sessions with an identity do (terminal ones are history, and a
// session attached with --id outside a repository has no identity).
func indexesIdentity(sess *Session) bool {
	return !sess.State.Terminal() && !sess.Identity.IsZero()
}

func validState(st State) bool {
	switch st {
	case StateCreating, StateProvisioning, StateReady, StateUnknown, StateExpired, StateStopped, StateFailed:
		return true
	}
	return false
}

// Get returns the session with this id, or an ErrNotFound error.
func (s *Store) Get(id string) (*Session, error) {
	var out *Session
	err := s.view(func(t *txn) error {
		var err error
		out, err = t.get(id)
		return err
	})
	return out, err
}

// ByIdentity returns the live (non-terminal) session of an identity, or an
// ErrNotFound error. Ended sessions of the identity are history and are
// found through List or ByRunID.
func (s *Store) ByIdentity(id Identity) (*Session, error) {
	var out *Session
	err := s.view(func(t *txn) error {
		sid := t.byIdentity.Get([]byte(id.Key()))
		if sid == nil {
			return notFound(fmt.Sprintf("no live session for %s on branch %s with config %s", id.RepoRoot, id.Branch, id.ConfigFile))
		}
		var err error
		out, err = t.get(string(sid))
		return err
	})
	return out, err
}

// ByRunID returns the session (live or ended) recorded for a run, or an
// ErrNotFound error.
func (s *Store) ByRunID(runID string) (*Session, error) {
	var out *Session
	err := s.view(func(t *txn) error {
		sid := t.byRun.Get([]byte(runID))
		if sid == nil {
			return notFound(fmt.Sprintf("no session for run %s", runID))
		}
		var err error
		out, err = t.get(string(sid))
		return err
	})
	return out, err
}

// List returns every session (live and history), oldest first, read in one
// transaction.
func (s *Store) List() ([]*Session, error) {
	var out []*Session
	err := s.view(func(t *txn) error {
		return t.sessions.ForEach(func(k, v []byte) error {
			sess, err := decodeSession(t.path, k, v)
			if err != nil {
				return err
			}
			out = append(out, sess)
			return nil
		})
	})
	if err != nil {
		return nil, err
	}
	slices.SortFunc(out, compareCreated)
	return out, nil
}

// Count returns the number of sessions, live and history.
func (s *Store) Count() (int, error) {
	var n int
	err := s.view(func(t *txn) error {
		n = t.sessions.Stats().KeyN
		return nil
	})
	return n, err
}

// Insert records a new session. An empty ID is filled in; CreatedAt is set
// from the clock unless already set (adopted runs keep their own);
// UpdatedAt is always set; an empty State means StateCreating. On success
// sess holds what was stored.
//
// It fails with *ExistsError (errors.Is ErrExists, kind Conflict) when the
// id is taken, when the identity already has a live session, or when the
// run id is already recorded (even by an ended session: attach to it with
// Update instead). This is how concurrent creators of one identity are
// resolved: exactly one Insert wins and the others get the winner.
func (s *Store) Insert(sess *Session) error {
	c := *sess
	if c.State == "" {
		c.State = StateCreating
	}
	if !validState(c.State) {
		return errdefs.Invalidf("insert session: unknown state %q", c.State)
	}
	if c.ID == "" {
		id, err := s.newID()
		if err != nil {
			return err
		}
		c.ID = id
	}
	now := s.now().UTC()
	if c.CreatedAt.IsZero() {
		c.CreatedAt = now
	}
	c.UpdatedAt = now
	if c.State.Terminal() && c.EndedAt.IsZero() {
		c.EndedAt = now
	}
	err := s.update(func(t *txn) error {
		if v := t.sessions.Get([]byte(c.ID)); v != nil {
			existing, err := decodeSession(t.path, []byte(c.ID), v)
			if err != nil {
				return err
			}
			return &ExistsError{Existing: existing, Field: "id"}
		}
		if err := t.index(nil, &c); err != nil {
			return err
		}
		return t.put(&c)
	})
	if err != nil {
		return err
	}
	*sess = c
	return nil
}

// Update applies fn to a copy of the session and stores the result, all in
// one transaction; an error from fn aborts it and is returned unchanged.
// Indices follow the change: a new run id or identity is indexed (failing
// with *ExistsError if another session holds it), and a session entering a
// terminal state releases its identity entry and gets EndedAt (leaving one
// clears it). ID and CreatedAt cannot change; UpdatedAt is set.
func (s *Store) Update(id string, fn func(*Session) error) (*Session, error) {
	var out *Session
	err := s.update(func(t *txn) error {
		old, err := t.get(id)
		if err != nil {
			return err
		}
		c := *old
		if err := fn(&c); err != nil {
			return err
		}
		if c.ID != old.ID {
			return errdefs.Invalidf("update session %s: the id cannot change (to %q)", id, c.ID)
		}
		if !validState(c.State) {
			return errdefs.Invalidf("update session %s: unknown state %q", id, c.State)
		}
		now := s.now().UTC()
		c.CreatedAt = old.CreatedAt
		c.UpdatedAt = now
		switch {
		case c.State.Terminal() && !old.State.Terminal() && c.EndedAt.IsZero():
			c.EndedAt = now
		case !c.State.Terminal():
			c.EndedAt = time.Time{}
		}
		if err := t.index(old, &c); err != nil {
			return err
		}
		if err := t.put(&c); err != nil {
			return err
		}
		out = &c
		return nil
	})
	return out, err
}

// Delete removes a session and its index entries, or returns an
// ErrNotFound error.
func (s *Store) Delete(id string) error {
	return s.update(func(t *txn) error {
		old, err := t.get(id)
		if err != nil {
			return err
		}
		return t.remove(old)
	})
}

// PruneHistory deletes the terminal sessions that ended before the given
// time and returns how many it deleted.
func (s *Store) PruneHistory(before time.Time) (int, error) {
	n := 0
	err := s.update(func(t *txn) error {
		var doomed []*Session
		err := t.sessions.ForEach(func(k, v []byte) error {
			sess, err := decodeSession(t.path, k, v)
			if err != nil {
				return err
			}
			ended := sess.EndedAt
			if ended.IsZero() {
				ended = sess.UpdatedAt
			}
			if sess.State.Terminal() && ended.Before(before) {
				doomed = append(doomed, sess)
			}
			return nil
		})
		if err != nil {
			return err
		}
		for _, sess := range doomed {
			if err := t.remove(sess); err != nil {
				return err
			}
		}
		n = len(doomed)
		return nil
	})
	return n, err
}

// Verify checks that every record decodes and that both indices agree with
// the records: each live session with an identity is in by_identity, each
// session with a run id is in by_run, and every index entry points to a
// session that owns it. It is a diagnostic (and what the crash tests
// assert); the store maintains these invariants itself.
func (s *Store) Verify() error {
	return s.view(func(t *txn) error {
		var problems []error
		byID := map[string]*Session{}
		err := t.sessions.ForEach(func(k, v []byte) error {
			sess, err := decodeSession(t.path, k, v)
			if err != nil {
				problems = append(problems, err)
				return nil
			}
			byID[sess.ID] = sess
			if indexesIdentity(sess) && string(t.byIdentity.Get([]byte(sess.Key()))) != sess.ID {
				problems = append(problems, fmt.Errorf("live session %s is not the identity index entry of its identity", sess.ID))
			}
			if sess.RunID != "" && string(t.byRun.Get([]byte(sess.RunID))) != sess.ID {
				problems = append(problems, fmt.Errorf("session %s is not the run index entry of run %s", sess.ID, sess.RunID))
			}
			return nil
		})
		if err != nil {
			return err
		}
		_ = t.byIdentity.ForEach(func(k, v []byte) error {
			if sess := byID[string(v)]; sess == nil || !indexesIdentity(sess) || sess.Key() != string(k) {
				problems = append(problems, fmt.Errorf("identity index entry %q points to session %s, which does not own it", k, v))
			}
			return nil
		})
		_ = t.byRun.ForEach(func(k, v []byte) error {
			if sess := byID[string(v)]; sess == nil || sess.RunID != string(k) {
				problems = append(problems, fmt.Errorf("run index entry %s points to session %s, which does not own it", k, v))
			}
			return nil
		})
		if len(problems) > 0 {
			return &CorruptError{Path: s.path, Err: errors.Join(problems...)}
		}
		return nil
	})
}

func (t *txn) get(id string) (*Session, error) {
	v := t.sessions.Get([]byte(id))
	if v == nil {
		return nil, notFound("session " + id)
	}
	return decodeSession(t.path, []byte(id), v)
}

func (t *txn) put(sess *Session) error {
	data, err := json.Marshal(sess)
	if err != nil {
		return fmt.Errorf("encode session %s: %w", sess.ID, err)
	}
	if err := t.sessions.Put([]byte(sess.ID), data); err != nil {
		return fmt.Errorf("write session %s to store %s: %w", sess.ID, t.path, err)
	}
	return nil
}

// owner returns the session an index entry points to, or nil when the entry
// is absent, points to self, or dangles (a dangling entry is overwritten:
// indices are derived data).
func (t *txn) owner(b interface{ Get([]byte) []byte }, key []byte, self string) (*Session, error) {
	v := b.Get(key)
	if v == nil || string(v) == self {
		return nil, nil
	}
	raw := t.sessions.Get(v)
	if raw == nil {
		return nil, nil
	}
	return decodeSession(t.path, v, raw)
}

// index moves the index entries of a session from its old version (nil for
// an insert) to its new one. It checks for collisions (*ExistsError) before
// changing anything, so a caller may skip the session and keep using the
// transaction.
func (t *txn) index(old, nw *Session) error {
	if indexesIdentity(nw) {
		other, err := t.owner(t.byIdentity, []byte(nw.Key()), nw.ID)
		if err != nil {
			return err
		}
		if other != nil && indexesIdentity(other) && other.Key() == nw.Key() {
			return &ExistsError{Existing: other, Field: "identity"}
		}
	}
	if nw.RunID != "" {
		other, err := t.owner(t.byRun, []byte(nw.RunID), nw.ID)
		if err != nil {
			return err
		}
		if other != nil && other.RunID == nw.RunID {
			return &ExistsError{Existing: other, Field: "run id"}
		}
	}

	id := []byte(nw.ID)
	if old != nil && indexesIdentity(old) && (!indexesIdentity(nw) || old.Key() != nw.Key()) {
		if err := t.unindex(t.byIdentity.Get, t.byIdentity.Delete, []byte(old.Key()), id); err != nil {
			return err
		}
	}
	if indexesIdentity(nw) {
		if err := t.byIdentity.Put([]byte(nw.Key()), id); err != nil {
			return err
		}
	}
	if old != nil && old.RunID != "" && old.RunID != nw.RunID {
		if err := t.unindex(t.byRun.Get, t.byRun.Delete, []byte(old.RunID), id); err != nil {
			return err
		}
	}
	if nw.RunID != "" {
		if err := t.byRun.Put([]byte(nw.RunID), id); err != nil {
			return err
		}
	}
	return nil
}

// unindex deletes an index entry only if it still points to id.
func (t *txn) unindex(get func([]byte) []byte, del func([]byte) error, key, id []byte) error {
	if bytes.Equal(get(key), id) {
		return del(key)
	}
	return nil
}

func (t *txn) remove(sess *Session) error {
	id := []byte(sess.ID)
	if !sess.Identity.IsZero() {
		if err := t.unindex(t.byIdentity.Get, t.byIdentity.Delete, []byte(sess.Key()), id); err != nil {
			return err
		}
	}
	if sess.RunID != "" {
		if err := t.unindex(t.byRun.Get, t.byRun.Delete, []byte(sess.RunID), id); err != nil {
			return err
		}
	}
	return t.sessions.Delete(id)
}

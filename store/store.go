package store

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"
)

// DefaultLockTimeout is how long Open waits for another process to release
// the database before failing with ErrLocked.
const DefaultLockTimeout = time.Second

// Options configure Open. The zero value is usable.
type Options struct {
	// LockTimeout bounds the wait for the exclusive lock (default 1s). A
	// context deadline shortens it further.
	LockTimeout time.Duration
	// Now is the clock for CreatedAt/UpdatedAt/EndedAt (default time.Now).
	Now func() time.Time
	// NewID generates session ids (default: 12 random bytes, hex).
	NewID func() (string, error)
	// Logger receives migrations and repairs (default: discarded).
	Logger *slog.Logger
}

// Store is the bbolt-backed session store. It is safe for concurrent use;
// every method is one bbolt transaction.
type Store struct {
	db    *bolt.DB
	path  string
	now   func() time.Time
	newID func() (string, error)
	log   *slog.Logger
}

// Open opens (creating if needed) the store at path: the parent directory
// is created 0700 and the file 0600. It takes bbolt's exclusive lock, which
// is also the daemon's single-instance guard, waiting at most
// opts.LockTimeout. A file that cannot be read is reported as a
// *CorruptError and left untouched; a file from a newer sandboxd as a
// *NewerSchemaError; an older schema is migrated, each step in its own
// transaction.
func Open(ctx context.Context, path string, opts Options) (*Store, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("open store %s: %w", path, err)
	}
	if opts.LockTimeout <= 0 {
		opts.LockTimeout = DefaultLockTimeout
	}
	if dl, ok := ctx.Deadline(); ok {
		if left := time.Until(dl); left < opts.LockTimeout {
			opts.LockTimeout = max(left, time.Millisecond)
		}
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.NewID == nil {
		opts.NewID = randomID
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("create the directory of store %s: %w", path, err)
	}

	// Inspect an existing file read-only first: a damaged file can make
	// bbolt panic while opening it read-write (it loads the freelist), and
	// a panicked Open cannot release its memory map, which keeps the lock.
	// Read-only, the freelist is loaded inside the consistency check, which
	// recovers. Nothing is written before the file has passed.
	if fi, err := os.Stat(path); err == nil && fi.Size() > 0 {
		if err := inspect(path, opts); err != nil {
			return nil, err
		}
	}
	db, err := openBolt(path, opts.LockTimeout, false)
	if err != nil {
		return nil, err
	}
	s := &Store{db: db, path: path, now: opts.Now, newID: opts.NewID, log: opts.Logger}
	if err := s.prepare(ctx); err != nil {
		_ = db.Close()
		return nil, err
	}
	s.tightenMode()
	return s, nil
}

// inspect checks an existing file's pages and schema version under a
// shared lock.
func inspect(path string, opts Options) error {
	db, err := openBolt(path, opts.LockTimeout, true)
	if err != nil {
		return err
	}
	defer db.Close()
	s := &Store{db: db, path: path, log: opts.Logger}
	if err := s.checkIntegrity(); err != nil {
		return err
	}
	version, err := s.schemaVersion()
	if err != nil {
		return err
	}
	if version > CurrentSchemaVersion {
		return &NewerSchemaError{Path: path, Version: version, Supported: CurrentSchemaVersion}
	}
	return nil
}

// openBolt opens the file, mapping bbolt's failures to typed errors and a
// panic of bbolt on a damaged file to a CorruptError (closing the file).
func openBolt(path string, timeout time.Duration, readOnly bool) (db *bolt.DB, err error) {
	var file *os.File
	defer func() {
		if r := recover(); r != nil {
			if file != nil {
				_ = file.Close()
			}
			db, err = nil, &CorruptError{Path: path, Err: fmt.Errorf("bbolt panicked while opening: %v", r)}
		}
	}()
	if err := checkNotTruncated(path); err != nil {
		return nil, err
	}
	db, err = bolt.Open(path, 0o600, &bolt.Options{
		Timeout:  timeout,
		ReadOnly: readOnly,
		OpenFile: func(name string, flag int, mode os.FileMode) (*os.File, error) {
			f, err := os.OpenFile(name, flag, mode)
			file = f
			return f, err
		},
	})
	switch {
	case err == nil:
		return db, nil
	case errors.Is(err, berrors.ErrTimeout):
		return nil, &LockedError{Path: path, Waited: timeout, Details: err}
	case errors.Is(err, berrors.ErrInvalid), errors.Is(err, berrors.ErrChecksum),
		errors.Is(err, berrors.ErrVersionMismatch), errors.Is(err, berrors.ErrInvalidMapping):
		return nil, &CorruptError{Path: path, Err: err}
	default:
		return nil, fmt.Errorf("open store %s: %w", path, err)
	}
}

// prepare reads the schema version (again: the file may have changed
// between inspect and taking the exclusive lock) and migrates.
func (s *Store) prepare(ctx context.Context) error {
	version, err := s.schemaVersion()
	if err != nil {
		return err
	}
	if version > CurrentSchemaVersion {
		return &NewerSchemaError{Path: s.path, Version: version, Supported: CurrentSchemaVersion}
	}
	if err := s.migrate(ctx, version); err != nil {
		return err
	}
	return s.view(func(t *txn) error { return nil }) // all buckets present
}

// checkIntegrity runs bbolt's page-level consistency check so that a
// damaged file is reported at start with its path rather than as a panic
// in the middle of a request later. Its cost is linear in the file size
// (see BenchmarkOpenAndList1000).
func (s *Store) checkIntegrity() (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = &CorruptError{Path: s.path, Err: fmt.Errorf("bbolt panicked while checking: %v", r)}
		}
	}()
	return s.db.View(func(tx *bolt.Tx) error {
		var errs []error
		for e := range tx.Check() {
			if len(errs) < 5 {
				errs = append(errs, e)
			}
		}
		if len(errs) > 0 {
			return &CorruptError{Path: s.path, Err: errors.Join(errs...)}
		}
		return nil
	})
}

// tightenMode makes sure a pre-existing file is not readable by others: it
// holds scoped tokens and private keys.
func (s *Store) tightenMode() {
	fi, err := os.Stat(s.path)
	if err != nil || fi.Mode().Perm()&0o077 == 0 {
		return
	}
	if err := os.Chmod(s.path, 0o600); err != nil {
		s.log.Warn("store file is readable by others and could not be restricted", "path", s.path, "mode", fi.Mode().Perm().String(), "err", err)
		return
	}
	s.log.Warn("store file was readable by others; restricted it to 0600", "path", s.path)
}

// Path is the database file.
func (s *Store) Path() string { return s.path }

// Close releases the database and its lock. Calling it twice is harmless.
func (s *Store) Close() error {
	if err := s.db.Close(); err != nil {
		return fmt.Errorf("close store %s: %w", s.path, err)
	}
	return nil
}

// Ping is a cheap liveness check (one read transaction) for the watchdog.
func (s *Store) Ping() error {
	return s.view(func(t *txn) error { return nil })
}

func randomID() (string, error) {
	var b [12]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("generate session id: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}

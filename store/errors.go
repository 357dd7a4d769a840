package store

import (
	"errors"
	"fmt"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
)

// Sentinels for errors.Is. The typed errors below wrap them.
var (
	// ErrLocked: another process (normally the running sandboxd) holds the
	// database's exclusive lock.
	ErrLocked = errors.New("store is locked by another process")
	// ErrCorrupt: the database file cannot be read as a sandboxd store.
	ErrCorrupt = errors.New("store is corrupt")
	// ErrNewerSchema: the file was written by a newer sandboxd.
	ErrNewerSchema = errors.New("store was written by a newer sandboxd")
	// ErrNotFound: no such session. Errors carrying it are also
	// errdefs.ErrNotFound.
	ErrNotFound = errors.New("session not found")
	// ErrExists: the session's id, identity or run id is already taken.
	// Errors carrying it are also errdefs.ErrConflict.
	ErrExists = errors.New("session already exists")
	// ErrLegacyMalformed: a legacy sandboxes.json cannot be parsed.
	ErrLegacyMalformed = errors.New("legacy sandboxes file is malformed")
)

// LockedError reports that the database is held by another process.
type LockedError struct {
	Path    string
	Waited  time.Duration
	Details error
}

func (e *LockedError) Error() string {
	return fmt.Sprintf("store %s is locked by another process (waited %s): another sandboxd is probably running; stop it (nook daemon stop) or use its socket", e.Path, e.Waited)
}

// Is makes errors.Is(err, ErrLocked) true.
func (e *LockedError) Is(target error) bool { return target == ErrLocked }

// Unwrap returns the underlying bbolt error.
func (e *LockedError) Unwrap() error { return e.Details }

// CorruptError reports a database file that cannot be read. The file is
// left exactly as it was found.
type CorruptError struct {
	Path string
	Err  error
}

func (e *CorruptError) Error() string {
	return fmt.Sprintf("store %s cannot be read (%v): sandboxd never recreates it silently; move it aside (mv %s %s.corrupt) and start sandboxd again to begin with an empty store", e.Path, e.Err, e.Path, e.Path)
}

// Is makes errors.Is(err, ErrCorrupt) true.
func (e *CorruptError) Is(target error) bool { return target == ErrCorrupt }

// Unwrap returns the cause.
func (e *CorruptError) Unwrap() error { return e.Err }

// NewerSchemaError reports a database whose schema is newer than this build
// understands.
type NewerSchemaError struct {
	Path      string
	Version   int // the file's schema version
	Supported int // the newest version this build knows
}

func (e *NewerSchemaError) Error() string {
	return fmt.Sprintf("store %s has schema version %d but this sandboxd supports up to version %d: it was written by a newer sandboxd; upgrade sandboxd (the file is left untouched)", e.Path, e.Version, e.Supported)
}

// Is makes errors.Is(err, ErrNewerSchema) true.
func (e *NewerSchemaError) Is(target error) bool { return target == ErrNewerSchema }

// ExistsError reports that a session could not be written because its id,
// identity (for a live session) or run id belongs to another session.
// Existing is that session; callers resolving a race use it as the winner.
// It is an errdefs.KindConflict error. Existing holds the token: never
// serialize it as is.
type ExistsError struct {
	Existing *Session
	// Field is what collided: "id", "identity" or "run id".
	Field string
}

func (e *ExistsError) Error() string {
	msg := fmt.Sprintf("a session with this %s already exists (session %s", e.Field, e.Existing.ID)
	if e.Existing.RunID != "" {
		msg += ", run " + e.Existing.RunID
	}
	return msg + ", state " + string(e.Existing.State) + ")"
}

// Unwrap makes errors.Is(err, ErrExists) and errors.Is(err,
// errdefs.ErrConflict) true and errdefs.KindOf(err) == KindConflict.
func (e *ExistsError) Unwrap() error { return errdefs.Conflict(ErrExists) }

func notFound(what string) error {
	return errdefs.NotFound(fmt.Errorf("%s: %w", what, ErrNotFound))
}

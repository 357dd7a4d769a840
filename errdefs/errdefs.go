// Package errdefs defines the error kinds shared by every layer (store,
// daemon, remote clients) and carried across the socket API. Daemon
// code wraps an error with a kind (errdefs.NotFound(err)); the ipc layer maps
// kinds to HTTP status codes and JSON error codes in one place; the client
// turns them back into the same kinds so callers branch with errors.Is.
package errdefs

import (
	"errors"
	"fmt"
)

// Kind is an error kind; its string is the JSON error code on the wire.
type Kind string

// Error kinds.
const (
	KindInvalid      Kind = "invalid"      // 400: the request is wrong
	KindUnauthorized Kind = "unauthorized" // 401/403: caller not allowed
	KindNotFound     Kind = "not_found"    // 404
	KindConflict     Kind = "conflict"     // 409: state forbids it now
	KindGone         Kind = "gone"         // 410: existed, is over
	KindTooLarge     Kind = "too_large"    // 413
	KindUnavailable  Kind = "unavailable"  // 503: remote/transient failure
	KindCanceled     Kind = "canceled"     // 499: the caller went away
	KindTimeout      Kind = "timeout"      // 504
	KindInternal     Kind = "internal"     // 500
	KindMethod       Kind = "method_not_allowed"
)

// Error carries a kind. It wraps the underlying error.
type Error struct {
	Kind Kind
	Err  error
}

func (e *Error) Error() string { return e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }

// Is makes errors.Is(err, errdefs.ErrNotFound) true for any error of that kind.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Err == nil && t.Kind == e.Kind
}

// Sentinels for errors.Is checks: errors.Is(err, errdefs.ErrNotFound).
var (
	ErrInvalid      = &Error{Kind: KindInvalid}
	ErrUnauthorized = &Error{Kind: KindUnauthorized}
	ErrNotFound     = &Error{Kind: KindNotFound}
	ErrConflict     = &Error{Kind: KindConflict}
	ErrGone         = &Error{Kind: KindGone}
	ErrTooLarge     = &Error{Kind: KindTooLarge}
	ErrUnavailable  = &Error{Kind: KindUnavailable}
	ErrCanceled     = &Error{Kind: KindCanceled}
	ErrTimeout      = &Error{Kind: KindTimeout}
	ErrInternal     = &Error{Kind: KindInternal}
)

func wrap(k Kind, err error) error {
	if err == nil {
		return nil
	}
	return &Error{Kind: k, Err: err}
}

// Constructors wrapping an existing error with a kind.
func Invalid(err error) error      { return wrap(KindInvalid, err) }
func Unauthorized(err error) error { return wrap(KindUnauthorized, err) }
func NotFound(err error) error     { return wrap(KindNotFound, err) }
func Conflict(err error) error     { return wrap(KindConflict, err) }
func Gone(err error) error         { return wrap(KindGone, err) }
func TooLarge(err error) error     { return wrap(KindTooLarge, err) }
func Unavailable(err error) error  { return wrap(KindUnavailable, err) }
func Canceled(err error) error     { return wrap(KindCanceled, err) }
func Timeout(err error) error      { return wrap(KindTimeout, err) }
func Internal(err error) error     { return wrap(KindInternal, err) }

// Invalidf is Invalid(fmt.Errorf(...)); likewise for the other f forms.
func Invalidf(format string, a ...any) error  { return Invalid(fmt.Errorf(format, a...)) }
func NotFoundf(format string, a ...any) error { return NotFound(fmt.Errorf(format, a...)) }
func Conflictf(format string, a ...any) error { return Conflict(fmt.Errorf(format, a...)) }

// KindOf returns the kind of the outermost kinded error in err's chain, or
// KindInternal when none is found.
func KindOf(err error) Kind {
	var e *Error
	if errors.As(err, &e) {
		return e.Kind
	}
	return KindInternal
}

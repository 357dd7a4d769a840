package runsapi

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/sandboxd/sandboxd/errdefs"
)

// Error kinds of the runs API. They are the ipc/errdefs sentinels, so the
// daemon passes an API error up to the socket API without translating it:
// errors.Is(err, runsapi.ErrGone) and errors.Is(err, errdefs.ErrGone) are the
// same check.
var (
	ErrNotFound     = errdefs.ErrNotFound     // 404: no such run (or never provisioned)
	ErrGone         = errdefs.ErrGone         // 410: the run existed and is over
	ErrUnauthorized = errdefs.ErrUnauthorized // 401/403: token refused
	ErrInvalid      = errdefs.ErrInvalid      // 400/422 and other 4xx: the request is wrong
	ErrConflict     = errdefs.ErrConflict     // 409
	ErrUnavailable  = errdefs.ErrUnavailable  // 5xx, 429, timeouts, connection errors, malformed answers
)

// APIError is a failed call to the runs API. Status is 0 when no HTTP answer
// arrived (connection error, timeout).
type APIError struct {
	Op      string // the call, e.g. "create run"
	Status  int
	Message string // the remote's error message, or what went wrong locally
	Err     error  // the transport error, when there was one
}

func (e *APIError) Error() string {
	msg := "runs API: " + e.Op + ": "
	if e.Status != 0 {
		msg += fmt.Sprintf("%d %s", e.Status, http.StatusText(e.Status))
		if e.Message != "" {
			msg += ": " + e.Message
		}
		return msg + e.advice()
	}
	msg += e.Message
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg + e.advice()
}

// advice says what to do about a failure on the remote's side.
func (e *APIError) advice() string {
	switch {
	case e.Status == http.StatusServiceUnavailable || e.Status == http.StatusTooManyRequests:
		return " (the remote is unavailable or overloaded for now: reads are retried by themselves; wait a minute and run the command again, `nook config` shows which remote this is)"
	case e.Status >= 500:
		return " (the remote failed on its side: run the command again; if it keeps failing, the remote's status or logs tell why, `nook config` shows which remote this is)"
	}
	return ""
}

func (e *APIError) Unwrap() error { return e.Err }

// Kind classifies the error.
func (e *APIError) Kind() errdefs.Kind {
	switch s := e.Status; {
	case s == 0:
		return errdefs.KindUnavailable
	case s == http.StatusNotFound:
		return errdefs.KindNotFound
	case s == http.StatusGone:
		return errdefs.KindGone
	case s == http.StatusUnauthorized || s == http.StatusForbidden:
		return errdefs.KindUnauthorized
	case s == http.StatusConflict:
		return errdefs.KindConflict
	case s == http.StatusTooManyRequests || s >= 500:
		return errdefs.KindUnavailable
	case s >= 400:
		return errdefs.KindInvalid
	default: // a 2xx/3xx we could not use
		return errdefs.KindUnavailable
	}
}

// Is matches the kind sentinels (runsapi.ErrX, which are errdefs.ErrX).
func (e *APIError) Is(target error) bool {
	t, ok := target.(*errdefs.Error)
	return ok && t.Err == nil && t.Kind == e.Kind()
}

// As lets errdefs.KindOf (which looks for an *errdefs.Error) see the kind.
func (e *APIError) As(target any) bool {
	if p, ok := target.(**errdefs.Error); ok {
		*p = &errdefs.Error{Kind: e.Kind(), Err: e}
		return true
	}
	return false
}

// retryable reports whether an idempotent call may be sent again.
func (e *APIError) retryable() bool {
	return e.Status == 0 || e.Status == http.StatusTooManyRequests || e.Status >= 500
}

// IsTransient reports whether err says nothing definite about the run: the
// remote could not be reached or failed (as opposed to a 4xx answer).
func IsTransient(err error) bool {
	var e *APIError
	return errors.As(err, &e) && e.Kind() == errdefs.KindUnavailable
}

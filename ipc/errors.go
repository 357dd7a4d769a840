package ipc

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"

	"github.com/sandboxd/sandboxd/ipc/errdefs"
)

// StatusClientClosed is the status recorded when the caller went away before
// the answer (nginx's 499); the caller never sees it.
const StatusClientClosed = 499

// StatusOf maps an error kind to its HTTP status. It is the one place where
// kinds become status codes; KindOfStatus is its inverse for answers that
// carry no JSON code.
func StatusOf(k errdefs.Kind) int {
	switch k {
	case errdefs.KindInvalid:
		return http.StatusBadRequest
	case errdefs.KindUnauthorized:
		return http.StatusForbidden
	case errdefs.KindNotFound:
		return http.StatusNotFound
	case errdefs.KindMethod:
		return http.StatusMethodNotAllowed
	case errdefs.KindConflict:
		return http.StatusConflict
	case errdefs.KindGone:
		return http.StatusGone
	case errdefs.KindTooLarge:
		return http.StatusRequestEntityTooLarge
	case errdefs.KindCanceled:
		return StatusClientClosed
	case errdefs.KindUnavailable:
		return http.StatusServiceUnavailable
	case errdefs.KindTimeout:
		return http.StatusGatewayTimeout
	default:
		return http.StatusInternalServerError
	}
}

// KindOfStatus maps an HTTP status to the error kind it stands for.
func KindOfStatus(status int) errdefs.Kind {
	switch status {
	case http.StatusBadRequest, http.StatusUnprocessableEntity:
		return errdefs.KindInvalid
	case http.StatusUnauthorized, http.StatusForbidden:
		return errdefs.KindUnauthorized
	case http.StatusNotFound:
		return errdefs.KindNotFound
	case http.StatusMethodNotAllowed:
		return errdefs.KindMethod
	case http.StatusConflict:
		return errdefs.KindConflict
	case http.StatusGone:
		return errdefs.KindGone
	case http.StatusRequestEntityTooLarge:
		return errdefs.KindTooLarge
	case StatusClientClosed:
		return errdefs.KindCanceled
	case http.StatusServiceUnavailable, http.StatusBadGateway, http.StatusTooManyRequests:
		return errdefs.KindUnavailable
	case http.StatusGatewayTimeout, http.StatusRequestTimeout:
		return errdefs.KindTimeout
	default:
		return errdefs.KindInternal
	}
}

// KnownKind reports whether code is one of the errdefs kinds.
func KnownKind(code string) bool {
	switch errdefs.Kind(code) {
	case errdefs.KindInvalid, errdefs.KindUnauthorized, errdefs.KindNotFound, errdefs.KindConflict,
		errdefs.KindGone, errdefs.KindTooLarge, errdefs.KindUnavailable, errdefs.KindCanceled,
		errdefs.KindTimeout, errdefs.KindInternal, errdefs.KindMethod:
		return true
	}
	return false
}

// kindOf is errdefs.KindOf, also recognising the standard errors that have
// an obvious kind when a backend did not wrap them.
func kindOf(err error) errdefs.Kind {
	var kinded *errdefs.Error
	if errors.As(err, &kinded) {
		return kinded.Kind
	}
	var tooLarge *http.MaxBytesError
	switch {
	case errors.As(err, &tooLarge):
		return errdefs.KindTooLarge
	case errors.Is(err, context.Canceled):
		return errdefs.KindCanceled
	case errors.Is(err, context.DeadlineExceeded):
		return errdefs.KindTimeout
	}
	return errdefs.KindInternal
}

// ErrorDetailOf is the wire form of err.
func ErrorDetailOf(err error) ErrorDetail {
	return ErrorDetail{Code: string(kindOf(err)), Message: err.Error()}
}

// writeError answers err as {"error":{...}} with the status of its kind.
func writeError(w http.ResponseWriter, r *http.Request, log *slog.Logger, err error) {
	d := ErrorDetailOf(err)
	status := StatusOf(errdefs.Kind(d.Code))
	if status >= 500 && status != http.StatusServiceUnavailable {
		log.Error("request failed", "method", r.Method, "path", r.URL.Path, "status", status, "err", err)
	} else {
		log.Debug("request refused", "method", r.Method, "path", r.URL.Path, "status", status, "err", err)
	}
	writeJSON(w, status, ErrorBody{Error: d})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		// Only unsupported values reach here: a bug, answered as such.
		status = http.StatusInternalServerError
		b, _ = json.Marshal(ErrorBody{Error: ErrorDetail{Code: string(errdefs.KindInternal), Message: "encode the response: " + err.Error()}})
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}

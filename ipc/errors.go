package ipc

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"slices"

	"github.com/sandboxd/sandboxd/errdefs"
)

// StatusClientClosed is the status recorded when the caller went away before
// the answer (nginx's 499); the caller never sees it.
const StatusClientClosed = 499

// kindStatuses is the one mapping between error kinds and HTTP statuses. A
// kind's first status is the one the server answers with; the others also
// stand for it in answers that carry no JSON code (a proxy, an older
// daemon). KindInternal is also the fallback both ways.
var kindStatuses = []struct {
	kind     errdefs.Kind
	statuses []int
}{
	{errdefs.KindInvalid, []int{http.StatusBadRequest, http.StatusUnprocessableEntity}},
	{errdefs.KindUnauthorized, []int{http.StatusForbidden, http.StatusUnauthorized}},
	{errdefs.KindNotFound, []int{http.StatusNotFound}},
	{errdefs.KindMethod, []int{http.StatusMethodNotAllowed}},
	{errdefs.KindConflict, []int{http.StatusConflict}},
	{errdefs.KindGone, []int{http.StatusGone}},
	{errdefs.KindTooLarge, []int{http.StatusRequestEntityTooLarge}},
	{errdefs.KindCanceled, []int{StatusClientClosed}},
	{errdefs.KindUnavailable, []int{http.StatusServiceUnavailable, http.StatusBadGateway, http.StatusTooManyRequests}},
	{errdefs.KindTimeout, []int{http.StatusGatewayTimeout, http.StatusRequestTimeout}},
	{errdefs.KindInternal, []int{http.StatusInternalServerError}},
}

// StatusOf maps an error kind to its HTTP status. It is the one place where
// kinds become status codes; KindOfStatus is its inverse for answers that
// carry no JSON code.
func StatusOf(k errdefs.Kind) int {
	for _, ks := range kindStatuses {
		if ks.kind == k {
			return ks.statuses[0]
		}
	}
	return http.StatusInternalServerError
}

// KindOfStatus maps an HTTP status to the error kind it stands for.
func KindOfStatus(status int) errdefs.Kind {
	for _, ks := range kindStatuses {
		if slices.Contains(ks.statuses, status) {
			return ks.kind
		}
	}
	return errdefs.KindInternal
}

// KnownKind reports whether code is one of the errdefs kinds.
func KnownKind(code string) bool {
	for _, ks := range kindStatuses {
		if string(ks.kind) == code {
			return true
		}
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

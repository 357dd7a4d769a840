package server

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

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

// errorDetailOf is the wire form of err.
func errorDetailOf(err error) ipc.ErrorDetail {
	return ipc.ErrorDetail{Code: string(kindOf(err)), Message: err.Error()}
}

// writeError answers err as {"error":{...}} with the status of its kind.
func writeError(w http.ResponseWriter, r *http.Request, log *slog.Logger, err error) {
	d := errorDetailOf(err)
	status := ipc.StatusOf(errdefs.Kind(d.Code))
	if status >= 500 && status != http.StatusServiceUnavailable {
		log.Error("request failed", "method", r.Method, "path", r.URL.Path, "status", status, "err", err)
	} else {
		log.Debug("request refused", "method", r.Method, "path", r.URL.Path, "status", status, "err", err)
	}
	writeJSON(w, status, ipc.ErrorBody{Error: d})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		// Only unsupported values reach here: a bug, answered as such.
		status = http.StatusInternalServerError
		b, _ = json.Marshal(ipc.ErrorBody{Error: ipc.ErrorDetail{Code: string(errdefs.KindInternal), Message: "encode the response: " + err.Error()}})
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}

package ipc

import (
	"slices"

	"github.com/sandboxd/sandboxd/errdefs"
)

// StatusClientClosed is the status recorded when the caller went away before
// the answer (nginx's 499); the caller never sees it.
const StatusClientClosed = 499

// kindStatuses is the one mapping between error kinds and HTTP statuses. A
// kind's first status is the one the server answers with; the others also
// stand for it in answers that carry no JSON code (a proxy, an older
// daemon). KindInternal is also the fallback both ways. The statuses are
// plain numbers so that the wire contract does not link net/http.
var kindStatuses = []struct {
	kind     errdefs.Kind
	statuses []int
}{
	{errdefs.KindInvalid, []int{400, 422}},      // Bad Request, Unprocessable Entity
	{errdefs.KindUnauthorized, []int{403, 401}}, // Forbidden, Unauthorized
	{errdefs.KindNotFound, []int{404}},
	{errdefs.KindMethod, []int{405}},
	{errdefs.KindConflict, []int{409}},
	{errdefs.KindGone, []int{410}},
	{errdefs.KindTooLarge, []int{413}},
	{errdefs.KindCanceled, []int{StatusClientClosed}},
	{errdefs.KindUnavailable, []int{503, 502, 429}}, // Service Unavailable, Bad Gateway, Too Many Requests
	{errdefs.KindTimeout, []int{504, 408}},          // Gateway Timeout, Request Timeout
	{errdefs.KindInternal, []int{500}},
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
	return 500
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

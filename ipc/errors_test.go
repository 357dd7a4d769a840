package ipc

import (
	"testing"

	"github.com/sandboxd/sandboxd/errdefs"
)

func TestStatusKindRoundTrip(t *testing.T) {
	for _, code := range []string{"invalid", "unauthorized", "not_found", "conflict", "gone", "too_large", "unavailable", "canceled", "timeout", "internal", "method_not_allowed"} {
		if !KnownKind(code) {
			t.Errorf("%s is not a known kind", code)
		}
		st := StatusOf(errdefs.Kind(code))
		if got := KindOfStatus(st); string(got) != code {
			t.Errorf("kind %s -> status %d -> kind %s", code, st, got)
		}
	}
	if StatusOf(errdefs.Kind("bogus")) != 500 {
		t.Error("an unknown kind must map to 500")
	}
}

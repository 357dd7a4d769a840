package server

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"unicode"

	"github.com/sandboxd/sandboxd/errdefs"
)

// decodeBody decodes a request body that must hold exactly one JSON value of
// v's type, with no unknown fields. An empty body is allowed only when
// emptyOK (routes whose request has no required field).
func decodeBody(r *http.Request, v any, emptyOK bool) error {
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		if errors.Is(err, io.EOF) {
			if emptyOK {
				return nil
			}
			return errdefs.Invalidf("the request body is empty: send a JSON object (GET /v1/openapi.yaml describes it)")
		}
		return jsonError(err)
	}
	if err := dec.Decode(&json.RawMessage{}); !errors.Is(err, io.EOF) {
		if err != nil {
			return jsonError(err)
		}
		return errdefs.Invalidf("the request body holds more than one JSON value: send exactly one object")
	}
	return nil
}

// jsonError says what was wrong with a JSON document, keeping the kind of a
// body that was too large.
func jsonError(err error) error {
	var (
		syntax   *json.SyntaxError
		typeErr  *json.UnmarshalTypeError
		tooLarge *http.MaxBytesError
	)
	switch {
	case errdefs.KindOf(err) == errdefs.KindTimeout:
		return err
	case errors.As(err, &tooLarge):
		return errdefs.TooLarge(fmt.Errorf("the request body is larger than the limit of %d bytes", tooLarge.Limit))
	case errors.As(err, &syntax):
		return errdefs.Invalidf("malformed JSON at byte %d: %v", syntax.Offset, err)
	case errors.As(err, &typeErr):
		field := jsonFieldPath(typeErr.Field)
		if field == "" {
			field = "the body"
		}
		return errdefs.Invalidf("wrong JSON type for %s: got %s, want %s", field, typeErr.Value, typeErr.Type)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return errdefs.Invalidf("malformed JSON: the body ends in the middle of a value")
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		// encoding/json has no typed error for unknown fields.
		return errdefs.Invalidf("unknown field %s: check the field names against the OpenAPI document", strings.TrimPrefix(err.Error(), "json: unknown field "))
	}
	return errdefs.Invalidf("malformed JSON: %v", err)
}

// query reads a request's query parameters strictly: a parameter the route
// does not know, or one given twice, is an error rather than silently
// ignored.
type query struct {
	values url.Values
	known  map[string]bool
	err    error
}

func newQuery(r *http.Request) *query {
	v, err := url.ParseQuery(r.URL.RawQuery)
	q := &query{values: v, known: map[string]bool{}}
	if err != nil {
		q.err = errdefs.Invalidf("malformed query string: %v", err)
	}
	return q
}

func (q *query) str(name string) string {
	q.known[name] = true
	vs := q.values[name]
	if len(vs) > 1 && q.err == nil {
		q.err = errdefs.Invalidf("query parameter %q is given %d times: give it once", name, len(vs))
	}
	if len(vs) == 0 {
		return ""
	}
	return vs[0]
}

func (q *query) boolean(name string) bool {
	s := q.str(name)
	if s == "" {
		return false
	}
	b, err := strconv.ParseBool(s)
	if err != nil && q.err == nil {
		q.err = errdefs.Invalidf("query parameter %s=%q is not a boolean: use true or false", name, s)
	}
	return b
}

func (q *query) uint64Ptr(name string) *uint64 {
	s := q.str(name)
	if s == "" {
		return nil
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil && q.err == nil {
		q.err = errdefs.Invalidf("query parameter %s=%q is not a sequence number: use a non-negative integer", name, s)
		return nil
	}
	return &n
}

// done returns the first error, including parameters nobody asked for.
func (q *query) done() error {
	if q.err != nil {
		return q.err
	}
	for name := range q.values {
		if !q.known[name] {
			known := make([]string, 0, len(q.known))
			for k := range q.known {
				known = append(known, k)
			}
			slices.Sort(known)
			if len(known) == 0 {
				return errdefs.Invalidf("unknown query parameter %q: this route takes none", name)
			}
			return errdefs.Invalidf("unknown query parameter %q: this route takes %s", name, strings.Join(known, ", "))
		}
	}
	return nil
}

// jsonFieldPath drops the Go names of embedded structs (Target.cwd -> cwd)
// from a decoder's field path, leaving the JSON names the caller sent.
func jsonFieldPath(p string) string {
	parts := strings.Split(p, ".")
	kept := parts[:0]
	for _, part := range parts {
		if part != "" && unicode.IsUpper([]rune(part)[0]) {
			continue
		}
		kept = append(kept, part)
	}
	return strings.Join(kept, ".")
}

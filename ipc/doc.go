// Package ipc is the wire contract of sandboxd's socket API (HTTP/1.1 over a
// Unix socket, routes under /v1, NDJSON streams for exec and events): the
// request, response and frame types, their validation, the header names and
// the mapping of error kinds to statuses. It links no HTTP machinery: the
// contract stands apart from its two ends, the server ipc/server and the
// one typed Go client ipc/client (both net/http).
package ipc

// Package ipc is the wire contract of sandboxd's socket API (HTTP/1.1 over a
// Unix socket, routes under /v1, NDJSON streams for exec and events): the
// request, response and frame types, their validation, the header names and
// the mapping of error kinds to statuses. It links no HTTP machinery, so
// that a client (nook starts on every command an agent runs) pays for none:
// the server is ipc/server, the one typed Go client ipc/client.
package ipc

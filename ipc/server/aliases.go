package server

import "github.com/sandboxd/sandboxd/ipc/backend"

// The interfaces this server calls are package backend's, which the daemon
// implements without importing the server; these names keep the server's
// code and its tests as they read.
type (
	Backends          = backend.Backends
	SessionBackend    = backend.SessionBackend
	ExecStream        = backend.ExecStream
	ExecResizer       = backend.ExecResizer
	EventSource       = backend.EventSource
	EventSubscription = backend.EventSubscription
	DaemonBackend     = backend.DaemonBackend
	SSHBackend        = backend.SSHBackend
)

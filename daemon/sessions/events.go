package sessions

import "github.com/sandboxd/sandboxd/daemon/events"

// Event types this package publishes.
const (
	eventSessionCreated  = events.SessionCreated
	eventSessionReady    = events.SessionReady
	eventProgress        = events.SessionProgress
	eventSessionExpired  = events.SessionExpired
	eventSessionStopped  = events.SessionStopped
	eventSessionAdopted  = events.SessionAdopted
	eventAdoptionRefused = events.SessionAdoptionRefused
	eventSessionPruned   = events.SessionPruned
	eventExecQueued      = events.ExecQueued
	eventExecStarted     = events.ExecStarted
	eventExecFinished    = events.ExecFinished
	eventPushed          = events.SyncPushed
	eventConfigDrift     = events.ConfigDrift
	eventReconciled      = events.ReconcileFinished
)

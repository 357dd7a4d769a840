package ipc

import "time"

// PruneRequest is POST /v1/sessions/prune: end and forget the sessions whose
// checkout is gone or whose run ended.
type PruneRequest struct {
	// DryRun lists what would be pruned and changes nothing.
	DryRun bool `json:"dryRun,omitempty"`
}

// Validate accepts every prune request.
func (r *PruneRequest) Validate() error { return nil }

// PruneResponse lists what was (or, with DryRun, would be) pruned.
type PruneResponse struct {
	DryRun bool            `json:"dryRun,omitempty"`
	Pruned []PrunedSession `json:"pruned"`
	// Warnings name sessions that could not be pruned and why.
	Warnings []string `json:"warnings,omitempty"`
}

// PrunedSession is one pruned session and why it was.
type PrunedSession struct {
	Session SessionInfo `json:"session"`
	// Why is "checkout_gone" or "run_ended".
	Why    string `json:"why"`
	Detail string `json:"detail"`
	// Stopped is true when the session's run was still live and was ended.
	Stopped bool `json:"stopped,omitempty"`
}

// Reasons of a prune.
const (
	PruneCheckoutGone = "checkout_gone"
	PruneRunEnded     = "run_ended"
)

// KeepRequest is POST /v1/sessions/keep: pin the target's sandbox so that
// the idle stop leaves it, or unpin it (Off).
type KeepRequest struct {
	Target
	Off bool `json:"off,omitempty"`
}

// Validate checks the target.
func (r *KeepRequest) Validate() error { return r.Target.Validate() }

// KeepResponse is the session as pinned (or unpinned).
type KeepResponse struct {
	Session SessionInfo `json:"session"`
}

// Expiring is the data of a session.expiring event: the run ends at
// ExpiresAt (as its remote reports), and the sandbox's edits were pulled
// ahead of it (applied, or saved and named), or Error says why not (the
// pull is tried again until the end).
type Expiring struct {
	ExpiresAt   time.Time `json:"expiresAt"`
	PulledFiles []string  `json:"pulledFiles"`
	SavedPatch  string    `json:"savedPatch,omitempty"`
	Warnings    []string  `json:"warnings,omitempty"`
	Error       string    `json:"error,omitempty"`
}

// IdleWarning is the data of a session.idle_warning event: the sandbox
// will be stopped at StopsAt unless it is used (or kept) before.
type IdleWarning struct {
	IdleSeconds int64     `json:"idleSeconds"`
	StopsAt     time.Time `json:"stopsAt"`
}

// Package store is sandboxd's local state: a bbolt database holding one
// record per session (the local record of one sandbox run) with indices by
// identity and by run id, a schema version with migrations, and the legacy
// import of the RWX CLI's sandboxes.json files.
package store

import (
	"time"
)

// State is the lifecycle state of a session.
type State string

// Lifecycle states. Active states keep the identity index; terminal states
// are history (kept for a bounded time so `nook list --all` can show them).
const (
	// StateCreating: the create call is under way; no run id yet.
	StateCreating State = "creating"
	// StateProvisioning: the run exists but is not sandboxable yet.
	StateProvisioning State = "provisioning"
	// StateReady: sandboxable; connection info known.
	StateReady State = "ready"
	// StateUnknown: runtime facts not (re)learned yet or last check was
	// transient (network error, timeout, 5xx). Never pruned for that.
	StateUnknown State = "unknown"
	// StateExpired: the remote says the run is over or gone.
	StateExpired State = "expired"
	// StateStopped: stopped by the user through sandboxd.
	StateStopped State = "stopped"
	// StateFailed: the run failed (for example a setup step failed).
	StateFailed State = "failed"
)

// Terminal reports whether the state is history (the run is over).
func (s State) Terminal() bool {
	switch s {
	case StateExpired, StateStopped, StateFailed:
		return true
	}
	return false
}

// Identity is what makes a session unique on this machine.
type Identity struct {
	RepoRoot   string `json:"repoRoot"`
	Branch     string `json:"branch"`
	ConfigFile string `json:"configFile"` // absolute path
}

// IsZero reports an empty identity (a session attached by run id outside
// any repository). Such sessions are not in the identity index.
func (i Identity) IsZero() bool { return i == Identity{} }

// Key is the identity index key.
func (i Identity) Key() string { return i.RepoRoot + "\x00" + i.Branch + "\x00" + i.ConfigFile }

// Session is the local record of one sandbox run.
type Session struct {
	ID string `json:"id"`
	Identity
	// Remote names the remote the run lives on ("local" or the RWX host).
	Remote string `json:"remote"`
	RunID  string `json:"runId,omitempty"`
	RunURL string `json:"runUrl,omitempty"`
	// Token is the run-scoped token. Never logged, never returned by list.
	Token          string    `json:"token,omitempty"`
	TokenExpiresAt time.Time `json:"tokenExpiresAt,omitzero"`
	IdempotencyKey string    `json:"idempotencyKey"`
	ConfigHash     string    `json:"configHash,omitempty"`
	// BaseSHA is the commit the run was created at (git.sha); sync diffs
	// against it.
	BaseSHA   string `json:"baseSha,omitempty"`
	OriginURL string `json:"originUrl,omitempty"`

	// Connection facts learned from the remote; trusted on rehydration
	// only as identity (the keys), re-checked before use.
	Address        string `json:"address,omitempty"`
	PublicHostKey  string `json:"publicHostKey,omitempty"`
	PrivateUserKey string `json:"privateUserKey,omitempty"`

	State       State     `json:"state"`
	StateReason string    `json:"stateReason,omitempty"`
	CreatedAt   time.Time `json:"createdAt"`
	UpdatedAt   time.Time `json:"updatedAt"`
	LastExecAt  time.Time `json:"lastExecAt,omitzero"`
	ExecCount   int64     `json:"execCount"`
	LastProbeAt time.Time `json:"lastProbeAt,omitzero"`
	EndedAt     time.Time `json:"endedAt,omitzero"`
	// Adopted is set when the session was created from a remote run (by
	// cli_state match or legacy import) rather than by a start.
	Adopted bool `json:"adopted,omitempty"`
	// Background are the background processes started through sandboxd
	// and their port forwards, reopened when the daemon starts again.
	Background []Background `json:"background,omitempty"`
	// Kept pins the sandbox: the idle stop never stops it (`nook keep`).
	Kept bool `json:"kept,omitempty"`
}

// Background is a managed background process of a session.
type Background struct {
	Name    string `json:"name"`
	Command string `json:"command"`
	// TargetPort is the sandbox port forwarded from LocalPort while
	// Forwarding (LocalPort is kept after a stop, for the next start).
	TargetPort int  `json:"targetPort,omitempty"`
	LocalPort  int  `json:"localPort,omitempty"`
	Forwarding bool `json:"forwarding,omitempty"`
	// Started is the command sandboxd started it with (the user's, or
	// their config's), never one a sandbox reported: what a restart runs
	// when the sandbox lost the process.
	Started string `json:"started,omitempty"`
}

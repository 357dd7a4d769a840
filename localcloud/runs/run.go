// Package runs is the registry of localcloud runs: their lifecycle
// (provisioning, sandboxable, completed), deadlines, scoped tokens, the
// sandbox agent of each sandboxable run, and the persisted state that lets
// the server come back after a restart with the same runs and keys.
package runs

import (
	"crypto/ed25519"
	"encoding/pem"
	"errors"
	"fmt"
	"time"

	"github.com/sandboxd/sandboxd/rwxapi"

	"golang.org/x/crypto/ssh"
)

// State is where a run is in its life.
type State string

// Run states.
const (
	Provisioning State = "provisioning"
	Sandboxable  State = "sandboxable"
	Completed    State = "completed"
)

// Reason says why a run completed.
type Reason string

// Completion reasons.
const (
	ReasonEnded     Reason = "ended"
	ReasonCancelled Reason = "cancelled"
	ReasonTimedOut  Reason = "timed_out"
	ReasonFailed    Reason = "failed"
)

// Errors callers branch on (the API maps them to 400, 404 and 410).
var (
	ErrInvalid  = errors.New("invalid run request")
	ErrNotFound = errors.New("run not found")
	ErrGone     = errors.New("run has ended")
	ErrClosed   = errors.New("localcloud is shutting down")
)

// Run is the persisted record of one run.
type Run struct {
	ID             string                 `json:"id"`
	Title          string                 `json:"title"`
	CLIState       string                 `json:"cli_state,omitempty"`
	IdempotencyKey string                 `json:"idempotency_key,omitempty"`
	Git            rwxapi.GitMetadata     `json:"git"`
	ConfigPath     string                 `json:"config_path"`
	Config         string                 `json:"config"`
	InitParams     []rwxapi.InitParameter `json:"init_params,omitempty"`
	State          State                  `json:"state"`
	Reason         Reason                 `json:"reason,omitempty"`
	Detail         string                 `json:"detail,omitempty"`
	// FailedTask is the key of the setup step that failed the run, and
	// FailedOutput the end of its output (both empty otherwise).
	FailedTask     string    `json:"failed_task,omitempty"`
	FailedOutput   string    `json:"failed_output,omitempty"`
	CreatedAt      time.Time `json:"created_at"`
	SandboxableAt  time.Time `json:"sandboxable_at,omitzero"`
	CompletedAt    time.Time `json:"completed_at,omitzero"`
	LastActivityAt time.Time `json:"last_activity_at,omitzero"`
	// ExpiresAt is the end of the run's maximum lifetime, fixed at creation.
	ExpiresAt time.Time `json:"expires_at"`
	// IdleTimeout is fixed at creation too.
	IdleTimeout time.Duration `json:"idle_timeout_ns"`
	// HostKeySeed and UserKeySeed are ed25519 seeds: the same keys come
	// back after a restart so that clients keep working.
	HostKeySeed []byte        `json:"host_key_seed"`
	UserKeySeed []byte        `json:"user_key_seed"`
	AgentAddr   string        `json:"agent_addr,omitempty"`
	Tokens      []TokenRecord `json:"tokens,omitempty"`
}

// TokenRecord is a scoped token, stored as a SHA-256 hash.
type TokenRecord struct {
	Hash      string    `json:"hash"`
	ExpiresAt time.Time `json:"expires_at"`
}

// IdleDeadline is when a sandboxable run with no activity ends.
func (r Run) IdleDeadline() time.Time {
	if r.State != Sandboxable || r.IdleTimeout <= 0 {
		return time.Time{}
	}
	last := r.LastActivityAt
	if last.IsZero() {
		last = r.SandboxableAt
	}
	return last.Add(r.IdleTimeout)
}

// Deadline is the earliest of the lifetime and idle deadlines that apply
// to the run's state.
func (r Run) Deadline() time.Time {
	d := r.ExpiresAt
	if idle := r.IdleDeadline(); !idle.IsZero() && idle.Before(d) {
		d = idle
	}
	return d
}

// Ended is the human description of a completed run.
func (r Run) Ended() string {
	if r.Detail == "" {
		return string(r.Reason)
	}
	return fmt.Sprintf("%s: %s", r.Reason, r.Detail)
}

func (r Run) hostSigner() (ssh.Signer, error) {
	if len(r.HostKeySeed) != ed25519.SeedSize {
		return nil, fmt.Errorf("run %s: stored host key is damaged", r.ID)
	}
	return ssh.NewSignerFromKey(ed25519.NewKeyFromSeed(r.HostKeySeed))
}

func (r Run) userPublicKey() (ssh.PublicKey, error) {
	if len(r.UserKeySeed) != ed25519.SeedSize {
		return nil, fmt.Errorf("run %s: stored user key is damaged", r.ID)
	}
	return ssh.NewPublicKey(ed25519.NewKeyFromSeed(r.UserKeySeed).Public())
}

// privateUserKeyPEM is the OpenSSH PEM form clients parse with
// ssh.ParsePrivateKey.
func (r Run) privateUserKeyPEM() (string, error) {
	block, err := ssh.MarshalPrivateKey(ed25519.NewKeyFromSeed(r.UserKeySeed), "")
	if err != nil {
		return "", fmt.Errorf("encode the user key of run %s: %w", r.ID, err)
	}
	return string(pem.EncodeToMemory(block)), nil
}

// publicHostKey is the authorized_keys form of the host key.
func (r Run) publicHostKey() (string, error) {
	s, err := r.hostSigner()
	if err != nil {
		return "", err
	}
	return string(ssh.MarshalAuthorizedKey(s.PublicKey())), nil
}

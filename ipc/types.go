package ipc

import (
	"encoding/json"
	"time"
)

// Header names used on every response.
const (
	HeaderVersion = "Sandboxd-Version"
	// HeaderWarning, when present, is a warning about the daemon's setup
	// that every answer carries (the client shows it once per command).
	HeaderWarning = "Sandboxd-Warning"
	// ContentTypeNDJSON is the content type of streamed responses.
	ContentTypeNDJSON = "application/x-ndjson"
)

// ErrorBody is the JSON body of every error response.
type ErrorBody struct {
	Error ErrorDetail `json:"error"`
}

// ErrorDetail is the error object: a stable code (errdefs.Kind) and a
// message that says what failed and what to do.
type ErrorDetail struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// VersionResponse is GET /v1/version.
type VersionResponse struct {
	Version   string    `json:"version"`
	GoVersion string    `json:"goVersion"`
	PID       int       `json:"pid"`
	StartedAt time.Time `json:"startedAt"`
}

// HealthResponse is GET /v1/health.
type HealthResponse struct {
	Status string `json:"status"` // "ok"
	Store  string `json:"store"`  // "ok" or the error
	// Config is "ok", or what is wrong with the config file as it is now
	// (the daemon keeps the configuration it last loaded); empty from
	// daemons that do not check.
	Config      string `json:"config,omitempty"`
	SocketPath  string `json:"socketPath,omitempty"`
	Database    string `json:"database"`
	Activated   bool   `json:"socketActivated"`
	Sessions    int    `json:"sessions"`
	LiveStreams int    `json:"liveStreams"`
	Connections int    `json:"connections"`
	// SSHHandshakes counts the SSH handshakes made since start: an exec on
	// a warm connection adds none.
	SSHHandshakes uint64  `json:"sshHandshakes"`
	UptimeSeconds float64 `json:"uptimeSeconds"`
	// Goroutines and HeapBytes (the heap live after the last garbage
	// collection) let a load test check that the daemon returns to its
	// starting level (no leak).
	Goroutines int    `json:"goroutines"`
	HeapBytes  uint64 `json:"heapBytes"`
}

// Target selects a session. Exactly one of (Cwd) or (RunID) identifies it;
// Cwd must be absolute; ConfigFile is optional and relative to Cwd when not
// absolute.
type Target struct {
	Cwd        string `json:"cwd,omitempty"`
	ConfigFile string `json:"configFile,omitempty"`
	RunID      string `json:"runId,omitempty"`
}

// StartRequest is POST /v1/sessions/start and POST /v1/sessions/reset.
type StartRequest struct {
	Target
	Wait bool `json:"wait,omitempty"`
	// Discard (reset only) ends the old sandbox without pulling its
	// edits first; the answer lists what was dropped.
	Discard bool              `json:"discard,omitempty"`
	Init    map[string]string `json:"init,omitempty"`
	// WaitTimeoutSeconds bounds --wait (default 10 minutes).
	WaitTimeoutSeconds int `json:"waitTimeoutSeconds,omitempty"`
}

// SessionInfo is the public view of a session (never includes the token or
// private keys).
type SessionInfo struct {
	ID          string     `json:"id"`
	RunID       string     `json:"runId"`
	RunURL      string     `json:"runUrl,omitempty"`
	Status      string     `json:"status"`
	Reason      string     `json:"reason,omitempty"`
	RepoRoot    string     `json:"repoRoot"`
	Branch      string     `json:"branch"`
	ConfigFile  string     `json:"configFile"`
	Remote      string     `json:"remote"`
	CreatedAt   time.Time  `json:"createdAt"`
	LastExecAt  *time.Time `json:"lastExecAt,omitempty"`
	ExecCount   int64      `json:"execCount"`
	EndedAt     *time.Time `json:"endedAt,omitempty"`
	Adopted     bool       `json:"adopted,omitempty"`
	ConfigDrift bool       `json:"configDrift,omitempty"`
	// Forwards are the local ports the daemon forwards to the sandbox.
	Forwards []Forward `json:"forwards,omitempty"`
	// IdleSeconds is how long a ready sandbox has been unused (no exec,
	// shell, SSH session, forward traffic or background process); absent
	// while it works.
	IdleSeconds *int64 `json:"idleSeconds,omitempty"`
	// IdleStopAt is when the idle stop would stop it (absent when no
	// idle_stop applies, while it works, or when it is kept).
	IdleStopAt *time.Time `json:"idleStopAt,omitempty"`
	// Kept is true when `nook keep` pinned it: the idle stop leaves it.
	Kept bool `json:"kept,omitempty"`
	// ExpiresAt is when the run ends, when its remote says (the local
	// remote does; RWX Cloud does not).
	ExpiresAt *time.Time `json:"expiresAt,omitempty"`
	// ExpiryPulledAt is when the sandbox's edits were pulled ahead of
	// ExpiresAt (absent until then).
	ExpiryPulledAt *time.Time `json:"expiryPulledAt,omitempty"`
}

// StartResponse answers start and reset.
type StartResponse struct {
	Session SessionInfo `json:"session"`
	// Created is false when an existing active session was reported.
	Created bool `json:"created"`
	// Replaced is the run id a reset stopped, if any.
	Replaced string   `json:"replaced,omitempty"`
	Warnings []string `json:"warnings,omitempty"`
	// Edits says what became of the replaced sandbox's edits.
	Edits *EndEdits `json:"edits,omitempty"`
}

// EndEdits says what became of a sandbox's edits when it ended (stop,
// reset): pulled into the checkout, saved, or (with discard) dropped.
type EndEdits struct {
	RunID string `json:"runId"`
	// PulledFiles were applied to the checkout.
	PulledFiles []string `json:"pulledFiles,omitempty"`
	// SavedPatch holds the edits that were not applied (a conflict).
	SavedPatch string `json:"savedPatch,omitempty"`
	// Discarded are the files whose edits were dropped (--discard).
	Discarded []string `json:"discarded,omitempty"`
	Warnings  []string `json:"warnings,omitempty"`
}

// PullRequest is POST /v1/pull: bring the edits the caller's sandbox
// holds back into the checkout now.
type PullRequest = Target

// PullResponse answers POST /v1/pull.
type PullResponse struct {
	RunID string   `json:"runId"`
	Files []string `json:"files"`
	// SavedPatch holds the edits that were not applied (a conflict).
	SavedPatch string   `json:"savedPatch,omitempty"`
	Warnings   []string `json:"warnings,omitempty"`
}

// ListRequest is GET /v1/sessions?all=true.
type ListRequest struct {
	All bool `json:"all,omitempty"`
}

// ListResponse answers GET /v1/sessions.
type ListResponse struct {
	Sessions []SessionInfo `json:"sessions"`
	Warnings []string      `json:"warnings,omitempty"`
}

// StopRequest is POST /v1/sessions/stop: one of Target (cwd or run id) or All.
type StopRequest struct {
	Target
	All bool `json:"all,omitempty"`
	// Discard ends the sandbox without pulling its edits first; the
	// answer lists what was dropped.
	Discard bool `json:"discard,omitempty"`
}

// StopResponse lists what was stopped, and what became of each one's
// edits.
type StopResponse struct {
	Stopped []SessionInfo `json:"stopped"`
	Edits   []EndEdits    `json:"edits,omitempty"`
}

// InitRequest is POST /v1/init.
type InitRequest struct {
	Cwd  string `json:"cwd"`
	File string `json:"file,omitempty"` // default .rwx/sandbox.yml under the repo root or cwd
}

// InitResponse answers init.
type InitResponse struct {
	File string `json:"file"`
}

// StatusRequest is GET /v1/status?cwd=&configFile=&runId=.
type StatusRequest = Target

// ProbeResponse is GET /v1/sessions/{id}/probe and part of status.
type ProbeResponse struct {
	Session     SessionInfo `json:"session"`
	Probe       string      `json:"probe"` // connected | expired | no_sandbox | unknown
	Detail      string      `json:"detail,omitempty"`
	ExpiresAt   *time.Time  `json:"expiresAt,omitempty"`
	HasSnapshot bool        `json:"hasSnapshot"`
	Lifecycle   Lifecycle   `json:"lifecycle"`
	// Isolation says which protections the remote's sandboxes have.
	Isolation string `json:"isolation,omitempty"`
	// Warnings are for the user's stderr (isolation none, for one).
	Warnings []string `json:"warnings,omitempty"`
}

// Lifecycle is the lifecycle summary of a probe.
type Lifecycle struct {
	State     string     `json:"state"`
	Reason    string     `json:"reason,omitempty"`
	Created   time.Time  `json:"created"`
	LastExec  *time.Time `json:"lastExec,omitempty"`
	ExecCount int64      `json:"execCount"`
	LastProbe *time.Time `json:"lastProbe,omitempty"`
}

// ConfigResponse is GET /v1/config: the effective remote, never the token.
type ConfigResponse struct {
	Remote                   string  `json:"remote"` // "local" or "rwx"
	Host                     string  `json:"host"`
	TokenSource              string  `json:"tokenSource,omitempty"` // where the token came from (never the token)
	ConfigFile               string  `json:"configFile"`
	CertFile                 string  `json:"certFile,omitempty"`
	ReconcileIntervalSeconds float64 `json:"reconcileIntervalSeconds"`
	// IdleStopSeconds is the idle stop in force (0: none).
	IdleStopSeconds float64 `json:"idleStopSeconds"`
}

// DoctorCheck is one check of GET /v1/doctor (and `nook doctor`).
type DoctorCheck struct {
	Name   string `json:"name"`
	OK     bool   `json:"ok"`
	Detail string `json:"detail"`
	Fix    string `json:"fix,omitempty"` // what to do when !OK
}

// DoctorResponse is GET /v1/doctor: the checks only the daemon can make
// (the remote, SSH to each live sandbox and its clock).
type DoctorResponse struct {
	Checks []DoctorCheck `json:"checks"`
}

// ExecRequest is the first NDJSON line of the POST /v1/exec request body.
// Later lines are ExecInput frames. A plain JSON body (curl -d) is a request
// with no stdin.
type ExecRequest struct {
	Target
	Argv   []string `json:"argv"`
	NoSync bool     `json:"noSync,omitempty"`
	// Reset replaces the sandbox (stop, then a new run) before running.
	Reset bool `json:"reset,omitempty"`
	// Root runs the command at the root of the sandbox's checkout; by
	// default it runs in the directory that corresponds to Cwd (the root
	// when Cwd is not inside the sandbox's repository).
	Root bool `json:"root,omitempty"`
	// Env is set in the remote command's environment (names are shell
	// variable names; values are passed quoted, byte for byte).
	Env map[string]string `json:"env,omitempty"`
	// Stdin says the client will send stdin frames; otherwise the remote
	// command's stdin is empty.
	Stdin bool `json:"stdin,omitempty"`
	// TTY runs the command on a pseudo-terminal of this type and size
	// (nook shell, nook exec -t): its stdout and stderr are then one stream
	// (stdout frames), and resize frames follow the caller's window.
	TTY *TTY `json:"tty,omitempty"`
	// Detach starts the command under the sandbox helper's holder and
	// answers at once with its ExecID (durable exec only): the command
	// runs on without a caller and nothing of it is pulled back.
	Detach bool `json:"detach,omitempty"`
	// Attach, instead of running Argv, follows the detached command of
	// this ExecID: all its output kept so far and on, then its exit code.
	Attach string `json:"attach,omitempty"`
}

// TTY is the pseudo-terminal an exec asks for.
type TTY struct {
	Term string `json:"term,omitempty"` // the caller's $TERM (default xterm)
	WindowSize
}

// WindowSize is a terminal's size in characters.
type WindowSize struct {
	Cols int `json:"cols"`
	Rows int `json:"rows"`
}

// PushRequest is POST /v1/push: sync the caller's working tree to its
// sandbox without running a command.
type PushRequest = Target

// PushResponse answers POST /v1/push.
type PushResponse struct {
	RunID  string   `json:"runId"`
	RunURL string   `json:"runUrl,omitempty"`
	Files  []string `json:"files"`
	Bytes  int      `json:"bytes"`
	// Commits says the local HEAD was pushed with git's protocol.
	Commits bool `json:"commits"`
	// PulledFiles are edits of an earlier exec the sandbox still held,
	// brought back first.
	PulledFiles []string `json:"pulledFiles,omitempty"`
	Warnings    []string `json:"warnings,omitempty"`
}

// ExecInput is a frame of the request body after the ExecRequest line.
type ExecInput struct {
	Stdin    []byte `json:"stdin,omitempty"`    // base64 in JSON
	StdinEOF bool   `json:"stdinEof,omitempty"` // no more stdin
	Signal   string `json:"signal,omitempty"`   // "INT", "TERM", "HUP", "QUIT", "KILL"
	// Resize is the caller's new terminal size (an exec with a TTY).
	Resize *WindowSize `json:"resize,omitempty"`
}

// Exec output frame types.
const (
	ExecQueued  = "queued"  // waiting for the sandbox; Position is set
	ExecStarted = "started" // the command is running
	ExecStdout  = "stdout"
	ExecStderr  = "stderr"
	ExecWarning = "warning" // Message is a warning for the user's stderr
	ExecExit    = "exit"    // last frame on success: Result is set
	ExecError   = "error"   // last frame on failure before/around the command
)

// ExecOutput is one NDJSON frame of the POST /v1/exec response.
type ExecOutput struct {
	Type     string       `json:"type"`
	Data     []byte       `json:"data,omitempty"` // stdout/stderr bytes, base64 in JSON
	Message  string       `json:"message,omitempty"`
	Position int          `json:"position,omitempty"`
	Result   *ExecResult  `json:"result,omitempty"`
	Error    *ErrorDetail `json:"error,omitempty"`
}

// ExecResult is the final result of an exec.
type ExecResult struct {
	RunID       string   `json:"runId"`
	RunURL      string   `json:"runUrl,omitempty"`
	ExitCode    int      `json:"exitCode"`
	Signal      string   `json:"signal,omitempty"`
	PulledFiles []string `json:"pulledFiles"`
	DurationMs  int64    `json:"durationMs"`
	Warnings    []string `json:"warnings,omitempty"`
	// ExecID names a detached command (ExecRequest.Detach).
	ExecID string `json:"execId,omitempty"`
}

// Event is one NDJSON record of GET /v1/events.
type Event struct {
	Seq       uint64          `json:"seq"`
	Time      time.Time       `json:"time"`
	Type      string          `json:"type"`
	SessionID string          `json:"sessionId,omitempty"`
	RunID     string          `json:"runId,omitempty"`
	Data      json.RawMessage `json:"data,omitempty"`
}

// DaemonStopResponse answers POST /v1/daemon/stop (202): the daemon is
// stopping; in-flight requests finish first.
type DaemonStopResponse struct {
	Status string `json:"status"` // "stopping"
}

// ReconcileResponse answers POST /v1/reconcile once the pass is over.
type ReconcileResponse struct {
	Status string `json:"status"` // "ok"
}

// EventStreamClosed is the type of the last event of a GET /v1/events stream
// that the daemon ended (slow consumer, replay point gone, shutdown). It is
// not part of the sequence: its Seq is 0 and its Data is a StreamClosed.
const EventStreamClosed = "stream.closed"

// StreamClosed is the Data of an EventStreamClosed event.
type StreamClosed struct {
	Code   string `json:"code"`   // an errdefs kind
	Reason string `json:"reason"` // what happened and what to do
}

// ValidSignal reports whether name is a signal an exec signal frame may
// carry (SSH signal names, without SIG).
func ValidSignal(name string) bool {
	switch name {
	case "ABRT", "ALRM", "FPE", "HUP", "ILL", "INT", "KILL", "PIPE", "QUIT", "SEGV", "TERM", "USR1", "USR2":
		return true
	}
	return false
}

// Package rwxapi is the wire contract of the RWX runs API: paths, request and
// answer bodies, and cli_state. Both sides use it: sandboxd's client
// (daemon/runsapi) and the sandboxd-localcloud server.
package rwxapi

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
)

// API paths of the runs API contract (the RWX runs API as the RWX CLI
// calls it; sandboxd-localcloud serves the same, docs/localcloud.md).
const (
	PathRuns                  = "/mint/api/runs"
	PathConnectionInfo        = "/mint/api/sandbox_connection_info"
	PathSandboxTokens         = "/mint/api/sandbox_tokens"
	PathInitTemplate          = "/mint/api/sandbox_init_template"
	PathLeaves                = "/mint/api/leaves"
	PathBaseDefault           = "/mint/api/base/default"
	PathSkillLatest           = "/api/skill/latest"
	PathTelemetry             = "/api/telemetry"
	PathResultsStatus         = "/mint/api/results/status"
	PathResultsPrompt         = "/mint/api/results/prompt"
	HeaderIdempotencyKey      = "Idempotency-Key"
	QueryResultStatus         = "result_status"
	QueryExecutionStatus      = "execution_status"
	QueryMyRuns               = "my_runs"
	ResultStatusSandboxed     = "sandboxed"
	ExecutionStatusInProgress = "in_progress"
)

// CancelPath is the path that cancels run id.
func CancelPath(runID string) string { return PathRuns + "/" + runID + "/cancel" }

// CreateRunRequest is the body of POST /mint/api/runs.
type CreateRunRequest struct {
	Run RunDefinition `json:"run"`
}

// RunDefinition describes the run to create.
type RunDefinition struct {
	Title                    string           `json:"title,omitempty"`
	CLIState                 string           `json:"cli_state,omitempty"`
	Git                      GitMetadata      `json:"git"`
	TaskDefinitions          []DirectoryEntry `json:"task_definitions"`
	MintDirectory            []DirectoryEntry `json:"mint_directory"`
	InitializationParameters []InitParameter  `json:"initialization_parameters,omitempty"`
	UseCache                 bool             `json:"use_cache"`
	// Patch is the RWX CLI's patch metadata object; sandboxd sends none and
	// the server keeps it opaque.
	Patch json.RawMessage `json:"patch,omitempty"`
	// TargetedTaskKeys is sent by the RWX CLI; kept so that a strict decoder
	// on the server accepts the real client's requests.
	TargetedTaskKeys []string `json:"targeted_task_keys,omitempty"`
}

// GitMetadata is the git part of a run definition.
type GitMetadata struct {
	Branch    string `json:"branch"`
	Sha       string `json:"sha"`
	OriginURL string `json:"origin_url"`
}

// DirectoryEntry is one file or directory sent with a run: the entries of
// task_definitions (the config file) and of mint_directory (the .rwx
// directory). Type is "file" or "dir".
type DirectoryEntry struct {
	Path         string `json:"path"`
	Type         string `json:"type"`
	Permissions  uint32 `json:"permissions"`
	FileContents string `json:"file_contents"`
}

// InitParameter is a key/value passed with --init.
type InitParameter struct {
	Key   string `json:"key"`
	Value string `json:"value"`
}

// CreateRunResult is the 201 answer of create run.
type CreateRunResult struct {
	RunID  string `json:"run_id"`
	RunURL string `json:"run_url"`
}

// ConnectionInfo is the answer of GET sandbox_connection_info.
type ConnectionInfo struct {
	Sandboxable    bool    `json:"sandboxable"`
	Address        string  `json:"address"`
	PublicHostKey  string  `json:"public_host_key"`
	PrivateUserKey string  `json:"private_user_key"`
	Polling        Polling `json:"polling"`
	// ExpiresAt is when the run will end (RFC 3339), set by remotes that
	// know it: the local remote (the earlier of its maximum lifetime and
	// idle deadline). RWX Cloud does not report it (its connection info
	// and run status carry no end); sandboxd's own field, optional.
	// sandboxd pulls the sandbox's edits pull_before_expiry ahead of it.
	ExpiresAt string `json:"expires_at,omitempty"`
	// Status says what the remote is doing while the run provisions
	// ("setup step deps (1/2)"), when it says: the local remote does; nook
	// shows it as progress.
	Status string `json:"status,omitempty"`
	// FailureReason says why a run completed before it became sandboxable
	// (failed, cancelled, timed_out), with Polling.Completed set: the
	// remote's answer then is 200, not 410, and results/prompt tells the
	// failed task and its output.
	FailureReason string `json:"failure_reason,omitempty"`
}

// RunStatusResult is the answer of GET results/status?id=RUN: the run's
// result once Polling.Completed.
type RunStatusResult struct {
	RunStatus *RunResult `json:"run_status,omitempty"`
	RunID     string     `json:"run_id,omitempty"`
	RunURL    string     `json:"run_url,omitempty"`
	Polling   Polling    `json:"polling"`
}

// RunResult is a run's (or a task's) result: succeeded, failed,
// cancelled, timed_out.
type RunResult struct {
	Result string `json:"result"`
}

// Polling tells a client waiting for a sandbox when to ask again.
type Polling struct {
	Completed bool  `json:"completed"`
	BackoffMs int64 `json:"backoff_ms"`
}

// SandboxTokenRequest is the body of POST sandbox_tokens.
type SandboxTokenRequest struct {
	RunID            string `json:"run_id"`
	ExpiresInSeconds int64  `json:"expires_in_seconds,omitempty"`
}

// SandboxToken is a token scoped to one run.
type SandboxToken struct {
	Token     string `json:"token"`
	ExpiresAt string `json:"expires_at"`
	RunID     string `json:"run_id"`
}

// ListRunsResult is the answer of the sandbox list call.
type ListRunsResult struct {
	Runs []RunSummary `json:"runs"`
}

// RunSummary is one run of the list.
type RunSummary struct {
	ID       string `json:"id"`
	RunURL   string `json:"run_url"`
	Title    string `json:"title"`
	CLIState string `json:"cli_state"`
}

// InitTemplateResult is the answer of GET sandbox_init_template.
type InitTemplateResult struct {
	Template string `json:"template"`
}

// ErrorBody is the JSON error body of the remote.
type ErrorBody struct {
	Error string `json:"error"`
}

// CLIState is the decoded cli_state stamped on a run: base64 (standard) of
// this JSON. Branch and ConfigFile are what the RWX CLI writes; the other
// fields are sandboxd's own and are absent from states written by others.
type CLIState struct {
	Branch     string `json:"branch"`
	ConfigFile string `json:"configFile"`
	// RepoRoot is the absolute repository root on the machine that started
	// the run (sandboxd only).
	RepoRoot string `json:"repoRoot,omitempty"`
	// OriginURL is the repository's origin URL (sandboxd only).
	OriginURL string `json:"originUrl,omitempty"`
	// ConfigRel is the config path relative to the repository root
	// (sandboxd only).
	ConfigRel string `json:"configRel,omitempty"`
}

// Encode returns the base64 form sent as cli_state.
func (s CLIState) Encode() string {
	b, _ := json.Marshal(s) // a struct of strings always marshals
	return base64.StdEncoding.EncodeToString(b)
}

// DecodeCLIState parses a cli_state written by sandboxd or by another client.
// Unknown fields are ignored so that newer writers stay readable.
func DecodeCLIState(encoded string) (CLIState, error) {
	var s CLIState
	raw, err := base64.StdEncoding.DecodeString(encoded)
	if err != nil {
		return s, fmt.Errorf("decode cli_state: not base64: %w", err)
	}
	if err := json.Unmarshal(raw, &s); err != nil {
		return s, fmt.Errorf("decode cli_state: not JSON: %w", err)
	}
	return s, nil
}

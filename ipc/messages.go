package ipc

import (
	"fmt"
	"strings"
)

// Beginnings of the messages of an exec that waits on a ready sandbox
// (queued frames, session.progress phase waiting): nook shows them as they
// come, without following the sandbox's start phases.
const (
	WaitingForLock = "waiting for the sandbox's lock"
	WaitingSilent  = "the connection to the sandbox went silent"
	WaitingConnect = "connecting to the sandbox since"
	WaitingHelper  = "waiting for the sandbox helper"
)

// IsWaitOnReady reports whether msg is one of those.
func IsWaitOnReady(msg string) bool {
	return strings.HasPrefix(msg, WaitingForLock) || strings.HasPrefix(msg, WaitingSilent) || strings.HasPrefix(msg, WaitingConnect) ||
		strings.HasPrefix(msg, WaitingHelper)
}

// DriftWarning is the one wording of the config-drift warning, shared by the
// daemon (exec warnings) and nook (status), so that users see one message.
func DriftWarning(configFile string) string {
	return fmt.Sprintf("%s changed since this sandbox started: run `nook reset` to start a sandbox with the new config", configFile)
}

// Phases of a sandbox's start, in order, as nook shows them and as
// session.progress events carry them (Progress.Phase).
const (
	PhaseDaemonStarting = "daemon_starting" // nook only: it starts sandboxd
	PhaseCreating       = "creating"        // asking the remote for a run
	PhaseCreated        = "created"         // the run exists (RunURL)
	PhaseProvisioning   = "provisioning"    // the remote sets it up (Message: its current step, when it says)
	PhaseConnecting     = "connecting"      // sandboxable: opening the SSH connection
	PhaseReady          = "ready"
	// PhaseWaiting: a ready sandbox's exec waits (for the agent's lock, for
	// a silent connection to be replaced); Message says for what and since
	// when.
	PhaseWaiting = "waiting"
)

// Progress is the data of a session.progress event.
type Progress struct {
	Phase      string `json:"phase"`
	Message    string `json:"message,omitempty"`
	RunURL     string `json:"runUrl,omitempty"`
	RepoRoot   string `json:"repoRoot,omitempty"`
	Branch     string `json:"branch,omitempty"`
	ConfigFile string `json:"configFile,omitempty"`
}

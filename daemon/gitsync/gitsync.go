// Package gitsync moves a local working tree into a sandbox's git checkout
// and the sandbox's edits back, in one remote command each way.
//
// The protocol, per synced exec:
//
//   - Prepare (local only): a binary-safe patch base→working tree, built with
//     a temporary index so the user's index and files are never touched.
//   - Push (one remote command): reset the sandbox to the base commit (this
//     also heals whatever an interrupted exec left), apply the patch, record
//     the synced tree as the commit SnapshotRef.
//   - the caller runs the user's command.
//   - Pull (one remote command): diff the sandbox's tree (untracked files
//     included) against SnapshotRef, keep that patch in the sandbox, revert
//     the sandbox to the base commit, send the patch; then apply it locally,
//     falling back to a 3-way merge and to --reject, never dropping either
//     side of a conflict.
//
// Between execs a sandbox is at rest: worktree == HEAD == BaseRef ==
// SnapshotRef, so a stray Pull finds nothing to bring back.
package gitsync

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"
)

// Refs the sync keeps in the sandbox's repository.
const (
	// SnapshotRef is the commit holding the synced tree: the pull baseline.
	// At rest it equals BaseRef.
	SnapshotRef = "refs/sandboxd/sync"
	// BaseRef is the commit the sandbox is reset to between execs.
	BaseRef = "refs/sandboxd/base"
)

// DefaultMaxPatchBytes bounds a patch in either direction.
const DefaultMaxPatchBytes int64 = 64 << 20

// Runner runs one command in the sandbox: an SSH exec request on a persistent
// connection. Commands run under /bin/sh -c in the root of the sandbox's git
// checkout. Each Run is one round trip.
type Runner interface {
	Run(ctx context.Context, command string, stdin io.Reader, stdout, stderr io.Writer) (exitCode int, err error)
}

// Options configure a Syncer. The zero value is usable.
type Options struct {
	// Git is the local git binary; default "git".
	Git string
	// MaxPatchBytes bounds the patch pushed and the patch pulled; default
	// DefaultMaxPatchBytes. Errors state the limit.
	MaxPatchBytes int64
	// Now stamps snapshot commits and saved patch files; default time.Now.
	Now func() time.Time
	// Logger receives debug records (sizes, durations); default discards.
	Logger *slog.Logger
}

// Syncer syncs working trees. It holds no per-repository state and is safe
// for concurrent use on different repositories and sandboxes.
type Syncer struct {
	git      string
	maxBytes int64
	now      func() time.Time
	log      *slog.Logger
}

// New returns a Syncer.
func New(o Options) *Syncer {
	s := &Syncer{git: o.Git, maxBytes: o.MaxPatchBytes, now: o.Now, log: o.Logger}
	if s.git == "" {
		s.git = "git"
	}
	if s.maxBytes <= 0 {
		s.maxBytes = DefaultMaxPatchBytes
	}
	if s.now == nil {
		s.now = time.Now
	}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	return s
}

// Patch is the local working tree's difference from the sandbox's base
// commit, ready to push.
type Patch struct {
	RepoRoot string
	BaseSHA  string
	// Data is a `git apply` patch (binary-safe); empty when the working tree
	// equals the base commit.
	Data []byte
	// Files are the paths the patch changes (the new path of a rename).
	Files []string
	// LFSFiles are changed Git LFS files left out of the patch.
	LFSFiles []string
	// Warnings are for the user: LFS files not synced, unresolved conflicts
	// from an earlier pull.
	Warnings []string
}

// PushResult describes a completed push.
type PushResult struct {
	// Snapshot is the commit SnapshotRef points to in the sandbox.
	Snapshot string
	Bytes    int
	Files    int
}

// PullResult describes a pull. It is meaningful even when Pull returns an
// error (a conflict still applies what it can).
type PullResult struct {
	// Files are the paths the sandbox changed (the new path of a rename).
	Files []string
	Bytes int
	// SavedPatch is the full patch from the sandbox, saved when it did not
	// apply cleanly or when LFS files were left out.
	SavedPatch string
	// ConflictFiles hold conflict markers from a 3-way merge.
	ConflictFiles []string
	// RejectFiles are the .rej files written for hunks that did not apply.
	RejectFiles []string
	// SkippedLFS are Git LFS files the sandbox changed, not applied locally.
	SkippedLFS []string
	Warnings   []string
}

// Sentinel errors, for errors.Is. Errors returned by this package also carry
// an ipc/errdefs kind.
var (
	ErrNotGitRepository = errors.New("not a git repository")
	ErrEmptyRepository  = errors.New("the repository has no commits")
	ErrBaseUnknown      = errors.New("the base commit is not in the local repository")
	ErrBaseMissing      = errors.New("the sandbox does not have the base commit")
	ErrNoGitDir         = errors.New("the sandbox has no .git directory")
	ErrNoGit            = errors.New("git is not installed in the sandbox")
	ErrPatchTooLarge    = errors.New("the patch is over the size limit")
	ErrApplyFailed      = errors.New("the patch does not apply in the sandbox")
	ErrNoSnapshot       = errors.New("the sandbox has no sync snapshot")
	ErrConflict         = errors.New("the sandbox's changes conflict with local changes")
	ErrSandboxGit       = errors.New("a git command failed in the sandbox")
	ErrTransfer         = errors.New("the patch from the sandbox arrived incomplete")
)

// syncError is an error with its own message that matches a sentinel and
// keeps its cause.
type syncError struct {
	msg      string
	sentinel error
	cause    error
}

func (e *syncError) Error() string { return e.msg }

func (e *syncError) Unwrap() []error {
	errs := []error{e.sentinel}
	if e.cause != nil {
		errs = append(errs, e.cause)
	}
	return errs
}

func newError(sentinel, cause error, format string, args ...any) error {
	return &syncError{msg: fmt.Sprintf(format, args...), sentinel: sentinel, cause: cause}
}

// ConflictError is returned by Pull when the sandbox's patch did not apply
// cleanly. Nothing is lost: the full patch is at SavedPatch, conflicting
// hunks are in ConflictFiles (markers) or RejectFiles.
type ConflictError struct {
	SavedPatch    string
	ConflictFiles []string
	RejectFiles   []string
	// Detail is git's explanation when a part applied neither way.
	Detail string
}

func (e *ConflictError) Error() string {
	var b strings.Builder
	b.WriteString("the sandbox's changes conflict with local changes made during the exec")
	if len(e.ConflictFiles) > 0 {
		fmt.Fprintf(&b, "; conflict markers (<<<<<<< ours / >>>>>>> theirs) in: %s", strings.Join(e.ConflictFiles, ", "))
	}
	if len(e.RejectFiles) > 0 {
		fmt.Fprintf(&b, "; hunks that did not apply are in: %s", strings.Join(e.RejectFiles, ", "))
	}
	if e.Detail != "" {
		fmt.Fprintf(&b, "; git said: %s", e.Detail)
	}
	fmt.Fprintf(&b, "; the full patch from the sandbox is saved at %s", e.SavedPatch)
	if len(e.RejectFiles) > 0 {
		b.WriteString("; once resolved, delete the .rej files")
	}
	return b.String()
}

// Is makes errors.Is(err, ErrConflict) true.
func (e *ConflictError) Is(target error) bool { return target == ErrConflict }

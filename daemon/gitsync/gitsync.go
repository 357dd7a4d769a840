// Package gitsync moves a local working tree into a sandbox's git checkout
// and the sandbox's edits back.
//
// Every synced exec does the same three things: make the local tree into a
// commit and a patch without touching the user's index (Prepare), make the
// sandbox's checkout equal to it and record the synced tree as SnapshotRef
// (push), run the command, and send back the sandbox's edits since
// SnapshotRef as a patch that is checked and applied locally, falling back
// to a 3-way merge and to .rej files (Pull, land, applyPulled). Commits the
// sandbox lacks go first by git's protocol (pushCommits, only when HEAD
// moved). Crash safety: the sandbox keeps an exec's edits
// (.git/sandboxd/pending) until a later push carries the acknowledgement
// (acks.go); a push that finds unacknowledged edits brings them back first.
//
// How each step is done depends on these switches:
//
//   - Full or incremental scan (local). Without Options.Changes every
//     Prepare stages the whole tree into a copy of the index (prepareFull).
//     With it (internal/watch.Trees), planIncremental looks only at the
//     paths the tracker names; prepareTracked falls back to the full scan
//     the first time, when the tracker is unsure, a config file changed,
//     the index is one the sync cannot read, HEAD moved too far, or the
//     changes are many (maxIncremental) or touch an ignore file, a
//     submodule or a special file (the fallback reasons in dirty.go).
//     The incremental way stages the changed paths with git itself, into
//     a sync index that holds only the paths differing from HEAD (`git
//     update-index` on it, then `git diff --cached` limited to those paths:
//     diffPaths), so its cost is what changed, not the tree's size. Git's
//     index format is not written in-process and every exchange carries
//     the patch (in its request, or in the Patch frame right behind an
//     early one): a synced exec with one changed file does not need them to
//     cost the same at 50,000 files as at 200 (the same two git processes
//     either way, BenchmarkPrepareOneFileChange; `make bench`'s synced rows
//     at 50,000 files are 0.9 to 1.3 times those at 200 with and without
//     them, the noise of the machine). One piece stays, because that
//     number needs it whenever the user's index changed (a git add, an
//     editor's git status): which paths the index tracks is read
//     in-process (userindex.go), 5 to 20 ms at 50,000 entries where `git
//     ls-files` and its parse take 50 to 90 ms.
//   - Request first or patch first (early.go). For an exec the helper
//     takes as one exchange (PrepareExchange), an incremental Prepare
//     whose files git stores as they are (no converting attribute,
//     core.autocrlf off), whose HEAD did not move and where no directory
//     appeared or went away, makes the native push's entries in-process
//     (the tracker's paths and the last diff's, hashed, at most
//     MaxFusedPatch) and sends the request at once; git's staging and
//     diff run meanwhile and the patch follows in a Patch frame, which the
//     helper reads only for the plain push. The exec waits for that diff
//     only when nothing ran; the next Prepare of the repository waits for
//     it (prepState's mutex); its failure
//     invalidates the state (the next Prepare scans everything) and, when
//     the helper needed the patch, nothing ran and the exec prepares again
//     (Fused.Again). Once done, the entries are checked against git's
//     staging (checkEarly); a disagreement turns the early request off for
//     the repository until its configuration or rules change. Every other
//     case, and every other caller of Prepare, computes the patch first.
//   - Apply what differs or read-tree (sandbox side of the plain push).
//     When the local index is at least largeIndexBytes (Patch.LargeTree)
//     the working tree moves by a patch of what differs; below, by a
//     two-way `git read-tree -m -u` (pushBody).
//
// The sandbox side (side.go) has two implementations, picked once per
// exec by sideOf from the Runner; an exec takes one of two paths, helper ×
// one exchange or shell × separate steps:
//
//   - The helper, one exchange (helperSide; Fuse, fused.go). When the
//     sandbox helper serves on the connection (HelperRunner), an exec
//     without a terminal is one exec request: the exec's shell finds the
//     repository, brings in setup's files (setupEdits) and becomes
//     `<helper> exchange`, which speaks the framed, versioned protocol of
//     internal/helperproto: the request (entries, patch, the stray, push
//     and pull scripts, the command) and the caller's stdin and signals on
//     its stdin; the helper's typed answers on its stdout (Exchange.Run
//     checks their order and bounds). A held exchange whose Runner is an
//     ExchangeRunner that takes it (the connection's relay, daemon/relay,
//     once it said it serves) runs in the relay's process instead: the
//     same frames, no exec request. In the sandbox (sandboxhelper) the
//     helper looks for edits made outside an exec by its native pull
//     against the tree the last pull left, else by the stray script;
//     pushes natively (in-process trees), else stages through its server
//     and runs the push script, then adopts the tree it made; starts the
//     command with its own pipes; pulls natively, else stages through its
//     server and runs the pull script. The scripts never call the helper:
//     it hands them what it found in their environment. An answer that
//     says nothing ran is believed only before Started; a stream that ends
//     after Started without Exit is reported, never re-run.
//   - The shell, separate steps (shellSide; Push, the command, Pull or
//     Save when the caller went away; remote.go): without a helper (none
//     installed yet, another platform), and, whatever the side, for
//     terminal execs and when the helper did not take the exchange
//     (another protocol version, a decline: Fused.Split). Each step is a
//     script of its own exec request, git and POSIX shell only, whose exit
//     status is that step's: 0, or one of the scripts' codes (remote.go:
//     80-92 and 127, each naming the step that failed), which no other
//     path reads. Revert and the fetch of a kept patch are shell steps
//     too.
package gitsync

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/internal/gitversion"
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

// DefaultMaxSavedPatchBytes bounds a patch from the sandbox that is over
// the patch limit and so is copied to a file under .git/sandboxd/pulls/
// instead of applied: a larger one is not copied (it stays in the
// sandbox).
const DefaultMaxSavedPatchBytes int64 = 1 << 30

// Runner runs one command in the sandbox: an SSH exec request on a persistent
// connection. Commands run under /bin/sh -c in the root of the sandbox's git
// checkout. Each Run is one round trip.
type Runner interface {
	Run(ctx context.Context, command string, stdin io.Reader, stdout, stderr io.Writer) (exitCode int, err error)
}

// PreambleRunner is a Runner that can send the first bytes of a command's
// stdin beside its exec request instead of after the agent's answer (one
// round trip less): the exchange's request goes that way.
type PreambleRunner interface {
	RunPreamble(ctx context.Context, command string, preamble []byte, stdin io.Reader, stdout, stderr io.Writer) (exitCode int, err error)
}

// ExchangeRunner is a Runner with a process already up in the sandbox
// that runs a held exchange in itself (the helper's relay): the exchange
// then costs no exec request and no process start. taken false: none is
// free now, and nothing was read from stdin or run.
type ExchangeRunner interface {
	RunExchange(ctx context.Context, x RelayedExchange, stdin io.Reader, stdout, stderr io.Writer) (exitCode int, taken bool, err error)
}

// RelayedExchange is an exchange for an ExchangeRunner: the shell its
// exec request would run before the helper (Setup, which prints the sync
// state directory; a no-op once any of SetupDone, paths under the git
// directory, exists), its opening frames (the hello and the request), and
// the id of its held command (Hold), which a caller that went away
// signals.
type RelayedExchange struct {
	Setup     string
	SetupDone []string
	Opening   []byte
	Hold      string
}

// Options configure a Syncer. The zero value is usable.
type Options struct {
	// Git is the local git binary; default "git".
	Git string
	// MaxPatchBytes bounds the patch pushed and the patch pulled; default
	// DefaultMaxPatchBytes. Errors state the limit.
	MaxPatchBytes int64
	// MaxSavedPatchBytes bounds the copy of a patch over MaxPatchBytes
	// (saved, not applied); default DefaultMaxSavedPatchBytes.
	MaxSavedPatchBytes int64
	// Now stamps snapshot commits and saved patch files; default time.Now.
	Now func() time.Time
	// Logger receives debug records (sizes, durations); default discards.
	Logger *slog.Logger
	// Changes, when set, tells Prepare which paths changed since its
	// previous call for a repository, so it looks only at those and starts
	// no process when nothing changed (internal/watch.Trees). Without it,
	// every Prepare scans the whole working tree.
	Changes ChangeTracker
	// Pause, for crash tests only, is called at named phases of a pull:
	// "pull-before-apply" (the patch arrived, nothing applied) and
	// "pull-before-ack" (applied, not yet acknowledged).
	Pause func(phase string)
}

// Syncer syncs working trees. It is safe for concurrent use on different
// repositories and sandboxes. Its only state is a cache of the commits it
// pushed to each sandbox (so an exec on an unchanged HEAD costs no push);
// the acknowledgements of pulls live in each repository.
type Syncer struct {
	git      string
	maxBytes int64
	maxSaved int64
	// saveWait is the base of the deadline of a saved patch's copy;
	// tests lower it.
	saveWait time.Duration
	now      func() time.Time
	log      *slog.Logger
	pause    func(string)
	changes  ChangeTracker
	// verify, for tests, checks every incremental patch against a full scan.
	verify bool
	// observe, for tests, learns how each Prepare was made.
	observe func(how string)
	// largeIndex is the size of an index from which the sandbox moves its
	// working tree by a patch of what differs (see Patch.LargeTree);
	// tests lower it.
	largeIndex int64

	// gitSafe says the local git's version was checked and its `git
	// apply` has no known escapes (checkGit).
	gitSafe atomic.Bool

	mu     sync.Mutex
	pushed map[string]string     // sandbox key → commit known to be there
	prep   map[string]*prepState // repository root → its last Prepare
	ended  map[string][]string   // repository root → held exchanges whose exit came (heldEnded)
}

// New returns a Syncer.
func New(o Options) *Syncer {
	s := &Syncer{git: o.Git, maxBytes: o.MaxPatchBytes, maxSaved: o.MaxSavedPatchBytes, saveWait: time.Minute, now: o.Now, log: o.Logger, pause: o.Pause, changes: o.Changes,
		pushed: map[string]string{}, prep: map[string]*prepState{}, ended: map[string][]string{}, largeIndex: largeIndexBytes}
	if s.pause == nil {
		s.pause = func(string) {}
	}
	if s.git == "" {
		s.git = "git"
	}
	if s.maxBytes <= 0 {
		s.maxBytes = DefaultMaxPatchBytes
	}
	if s.maxSaved <= 0 {
		s.maxSaved = DefaultMaxSavedPatchBytes
	}
	if s.now == nil {
		s.now = time.Now
	}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	return s
}

// Patch is the local working tree as the sandbox needs it: a commit and
// the working tree's difference from it, ready to push.
type Patch struct {
	RepoRoot string
	// BaseSHA is the commit the sandbox started at.
	BaseSHA string
	// HeadSHA is the local HEAD, the commit the sandbox is reset to.
	HeadSHA string
	// Sandbox names the sandbox (its run id) for the cache of pushed
	// commits; empty disables the cache.
	Sandbox string
	// PushOnly says no pull follows (nook push): the push records no pending
	// edits, so the next exec's push does not bring back what happens in
	// the sandbox meanwhile.
	PushOnly bool
	// Data is a `git apply` patch (binary-safe); empty when the working tree
	// equals HEAD.
	Data []byte
	// Files are the paths the patch changes (the new path of a rename).
	Files []string
	// LFSFiles are changed Git LFS files left out of the patch.
	LFSFiles []string
	// Warnings are for the user: LFS files not synced, unresolved conflicts
	// from an earlier pull.
	Warnings []string
	// recs are the diff's records: the native push's entries are made
	// from them (and LFSFiles), only when a sandbox helper will take them
	// (nativeEntries reads the changed files).
	recs []rawRec
	// early is set on the Patch of an early request (PrepareExchange):
	// Data, Files and recs are set once its done is closed, and only
	// read after.
	early *earlyPatch
	// LargeTree says the repository's index is large (largeIndexBytes): the
	// sandbox then moves its working tree to the pushed tree by applying
	// what differs, whose cost is what changed, rather than by a two-way
	// read-tree, whose cost is the whole tree but which starts one process
	// fewer and so wins below the bound (docs/performance.md).
	LargeTree bool
}

// largeIndexBytes is the index size from which a tree counts as large:
// about 1,500 entries.
const largeIndexBytes = 128 << 10

// PushResult describes a completed push.
type PushResult struct {
	// Snapshot is the commit SnapshotRef points to in the sandbox.
	Snapshot string
	Bytes    int
	Files    int
	// Commits says the local HEAD was pushed with git's protocol.
	Commits bool
	// Pending is the id under which the sandbox keeps this exec's edits
	// until they are pulled; empty for a push-only sync.
	Pending string
	// Recovered is the pull of an earlier exec whose edits were never
	// brought back (the daemon died before the end of its pull).
	Recovered *PullResult
	// Again says the push was not done because the recovered edits changed
	// the local working tree: Prepare and Push again.
	Again bool
	// Warnings are for the user (a recovered pull, a conflict in it).
	Warnings []string
}

// PullResult describes a pull. It is meaningful even when Pull returns an
// error (a conflict still applies what it can).
type PullResult struct {
	// ID identifies the exec whose edits these are.
	ID string
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
	// Refused are the sandbox's changes that were not applied: content
	// the user's tools would execute or misread (a directory git would
	// take for a repository, a symlink out of the checkout, a name with
	// control characters) or a path sandboxd owns. SavedPatch keeps them.
	Refused  []Refused
	Warnings []string
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
	ErrPushCommits      = errors.New("git push to the sandbox failed")
	// ErrForgedReport: the sandbox's answer broke the protocol in a way
	// only a process of the sandbox could (a report after the command
	// started that says it did not run, a frame without the helper's tag,
	// no answer at all from a helper that exited 0).
	ErrForgedReport = errors.New("the sandbox's report was forged by the command")
	// ErrUnsafeGit: the local git's `git apply` has known escapes
	// (gitversion.ErrUnsafe): nothing from a sandbox is applied with it.
	ErrUnsafeGit = gitversion.ErrUnsafe
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

// checkGit refuses a local git whose `git apply` has known escapes; a
// good answer is kept, a bad one asked again (git may be upgraded).
func (s *Syncer) checkGit(ctx context.Context) error {
	if s.gitSafe.Load() {
		return nil
	}
	if _, err := gitversion.Check(ctx, s.git); err != nil {
		if errors.Is(err, gitversion.ErrUnsafe) {
			return errdefs.Conflict(err)
		}
		return err
	}
	s.gitSafe.Store(true)
	return nil
}

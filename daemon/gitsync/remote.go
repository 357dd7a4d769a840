package gitsync

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
)

// Exit codes of the sandbox scripts. They sit above git's own codes (0, 1,
// 128) and below the shell's (126, 127, 128+n) so each step is told apart.
const (
	exitGitFailed   = 80 // git could not read the repository
	exitNoGitDir    = 81
	exitNoBase      = 82
	exitApply       = 83
	exitSnapshot    = 84
	exitClean       = 85
	exitNoSnapshot  = 86
	exitDiff        = 87
	exitRevert      = 88 // the patch was sent; only the revert failed
	exitTooLarge    = 89
	exitNoPullPatch = 90
	exitNoGit       = 127
)

// prelude finds git and the repository and defines the helpers every script
// uses. The sandbox's PATH may be minimal, so common locations are added.
// safe.directory lets git read a checkout owned by another sandbox user;
// no repository hook runs during sync. Every process counts on the hot
// path, so shell builtins are preferred.
const prelude = `PATH="$PATH:/usr/local/bin:/usr/bin:/bin"; export PATH
if [ ! -e .git ]; then echo "sandboxd: there is no .git in $PWD" >&2; exit 81; fi
if ! command -v git >/dev/null 2>&1; then echo "sandboxd: git is not installed in the sandbox" >&2; exit 127; fi
g() { git -c safe.directory='*' -c core.hooksPath=/dev/null "$@"; }
if [ -d .git ]; then gd="$PWD/.git"; else gd=$(g rev-parse --absolute-git-dir) || exit 80; fi
st="$gd/sandboxd"
[ -d "$st" ] || mkdir -p "$st" || exit 80
SNAP=` + SnapshotRef + `
BASE=` + BaseRef + `
# revert COMMIT: index and files back to COMMIT, untracked files removed
# (ignored ones, such as build caches, are kept), both refs at COMMIT.
revert() {
	g reset -q --hard "$1" && g clean -fdq &&
	printf 'update %s %s\nupdate %s %s\n' "$SNAP" "$1" "$BASE" "$1" | g update-ref --stdin &&
	{ [ ! -e "$st/index" ] || rm -f "$st/index"; }
}
# stageall: the worktree, untracked files included, into the sync index
# (a copy of the real index, so unchanged files are not rehashed).
stageall() {
	if [ ! -f "$st/index" ] && [ -f "$gd/index" ]; then cp "$gd/index" "$st/index" || return 1; fi
	GIT_INDEX_FILE="$st/index" g add -A
}
`

// pushScript resets the sandbox to base, applies the patch from stdin when
// withPatch, and records the snapshot; it prints the snapshot commit.
func pushScript(base string, withPatch bool, now time.Time) string {
	var b strings.Builder
	b.WriteString(prelude)
	fmt.Fprintf(&b, "base=%s\n", base)
	// The reset fails, touching nothing, when base is missing; only then is
	// it worth a look at why.
	b.WriteString(`if ! revert "$base"; then
	if ! g cat-file -e "$base^{commit}" 2>/dev/null; then echo "sandboxd: commit $base is not in the sandbox" >&2; exit 82; fi
	exit 85
fi
`)
	if !withPatch {
		b.WriteString("echo \"$base\"\n")
		return b.String()
	}
	date := fmt.Sprintf("@%d +0000", now.Unix())
	fmt.Fprintf(&b, `if ! g apply --whitespace=nowarn -; then revert "$base"; exit 83; fi
if stageall && tree=$(GIT_INDEX_FILE="$st/index" g write-tree) &&
	snap=$(GIT_AUTHOR_DATE=%[1]q GIT_COMMITTER_DATE=%[1]q g -c user.name=sandboxd -c user.email=sandboxd@localhost commit-tree "$tree" -p "$base" -m "sandboxd sync") &&
	g update-ref "$SNAP" "$snap"; then
	echo "$snap"
else
	revert "$base"; exit 84
fi
`, date)
	return b.String()
}

// pullHeader starts the pull output; the patch's size follows so a
// truncated transfer is noticed.
const pullHeader = "sandboxd-pull "

// pullScript writes the sandbox's changes since the snapshot to
// $st/pull.patch (kept until the next pull, tagged with the pull's id in
// $st/pull.id, so a broken transfer can be fetched again), reverts the
// sandbox to its base, and prints the header and the patch.
func pullScript(id string, max int64) string {
	var b strings.Builder
	b.WriteString(prelude)
	fmt.Fprintf(&b, "id=%s\nmax=%d\n", id, max)
	fmt.Fprintf(&b, `refs=$(g rev-parse "$SNAP^{commit}" "$BASE^{commit}" 2>/dev/null) || { echo "sandboxd: no sync snapshot: nothing was pushed" >&2; exit 86; }
set -- $refs; snap=$1; base=$2
out="$st/pull.patch"
echo >"$st/pull.id"
stageall && GIT_INDEX_FILE="$st/index" g diff --cached %s "$snap" -- >"$out" || exit 87
echo "$id" >"$st/pull.id"
size=$(($(wc -c <"$out")))
revert "$base"; rv=$?
if [ "$size" -gt "$max" ]; then echo "$size" >&2; exit 89; fi
printf '%s%%d\n' "$size"
cat "$out" || exit 87
[ "$rv" -eq 0 ] || exit 88
`, strings.Join(diffOptions, " "), pullHeader)
	return b.String()
}

// keptPatch is where the sandbox keeps the last pull's patch.
const keptPatch = ".git/sandboxd/pull.patch"

// fetchScript prints the kept pull patch again if it is pull id's.
func fetchScript(id string) string {
	return prelude + fmt.Sprintf(`kept=; read -r kept <"$st/pull.id" || true
[ "$kept" = %s ] || exit 90
printf '%s%%d\n' "$(($(wc -c <"$st/pull.patch")))"
cat "$st/pull.patch"
`, id, pullHeader)
}

// revertScript returns the sandbox to its base commit.
const revertScript = prelude + `base=$(g rev-parse -q --verify "$BASE^{commit}") || base=$(g rev-parse -q --verify "HEAD^{commit}") || exit 80
revert "$base" || exit 88
`

// Push makes the sandbox's working tree equal to the one p was prepared
// from, in one Runner call: it resets the sandbox to p.BaseSHA (cleaning
// whatever an interrupted exec left), applies p, and records the synced tree
// as SnapshotRef, the baseline of the next Pull. HEAD and the sandbox's
// index stay at the base commit.
func (s *Syncer) Push(ctx context.Context, r Runner, p *Patch) (PushResult, error) {
	if p == nil || !shaPattern.MatchString(p.BaseSHA) {
		return PushResult{}, errdefs.Invalid(fmt.Errorf("push: no prepared patch with a base commit"))
	}
	if int64(len(p.Data)) > s.maxBytes {
		return PushResult{}, errdefs.TooLarge(newError(ErrPatchTooLarge, nil, "the sync patch is %s, over the %s limit: commit and push large files, or add them to .gitignore, or use --no-sync", formatBytes(int64(len(p.Data))), formatBytes(s.maxBytes)))
	}
	start := time.Now()
	var stdout, stderr bytes.Buffer
	withPatch := len(p.Data) > 0
	var code int
	var err error
	if withPatch {
		code, err = r.Run(ctx, pushScript(p.BaseSHA, true, s.now()), bytes.NewReader(p.Data), &stdout, &limitedBuffer{max: 64 << 10, buf: &stderr})
	} else {
		code, err = r.Run(ctx, pushScript(p.BaseSHA, false, s.now()), nil, &stdout, &limitedBuffer{max: 64 << 10, buf: &stderr})
	}
	if err != nil {
		return PushResult{}, errdefs.Unavailable(fmt.Errorf("push your changes to the sandbox: %w", err))
	}
	msg := strings.TrimSpace(stderr.String())
	switch code {
	case 0:
	case exitNoGitDir:
		return PushResult{}, errdefs.Gone(newError(ErrNoGitDir, nil, "the sandbox has no .git directory, so your changes cannot be synced: stop this sandbox and start a new one"))
	case exitNoGit:
		return PushResult{}, errdefs.Conflict(newError(ErrNoGit, nil, "git is not installed in the sandbox: add a task that installs git before the sandbox task, or use --no-sync"))
	case exitNoBase:
		return PushResult{}, errdefs.Conflict(newError(ErrBaseMissing, nil,
			"the sandbox does not have commit %s, which your changes are based on: push it (`git push`) and run `sbx reset`, or use --no-sync", short(p.BaseSHA)))
	case exitApply:
		return PushResult{}, errdefs.Conflict(newError(ErrApplyFailed, nil, "your changes did not apply in the sandbox (it was reset to %s): %s; run `sbx reset` if this persists", short(p.BaseSHA), msg))
	default:
		return PushResult{}, errdefs.Unavailable(newError(ErrSandboxGit, nil, "push your changes to the sandbox: %s (exit %d): %s", pushStep(code), code, msg))
	}
	res := PushResult{Snapshot: strings.TrimSpace(stdout.String()), Bytes: len(p.Data), Files: len(p.Files)}
	s.log.Debug("sync pushed", "bytes", res.Bytes, "files", res.Files, "snapshot", res.Snapshot, "took", time.Since(start))
	return res, nil
}

func pushStep(code int) string {
	switch code {
	case exitClean:
		return "resetting the sandbox to its base commit failed"
	case exitSnapshot:
		return "recording the sync snapshot failed"
	case exitGitFailed:
		return "git could not read the sandbox's repository"
	}
	return "the sync script failed"
}

// Revert returns the sandbox to its base commit in one Runner call: tracked
// files reset, untracked files removed (ignored ones kept), index reset.
// Pull already does this; Revert is for paths that did not pull.
func (s *Syncer) Revert(ctx context.Context, r Runner) error {
	var stderr bytes.Buffer
	code, err := r.Run(ctx, revertScript, nil, nil, &limitedBuffer{max: 64 << 10, buf: &stderr})
	if err != nil {
		return errdefs.Unavailable(fmt.Errorf("revert the sandbox: %w", err))
	}
	switch code {
	case 0:
		return nil
	case exitNoGitDir:
		return errdefs.Gone(newError(ErrNoGitDir, nil, "the sandbox has no .git directory: stop this sandbox and start a new one"))
	case exitNoGit:
		return errdefs.Conflict(newError(ErrNoGit, nil, "git is not installed in the sandbox"))
	}
	return errdefs.Unavailable(newError(ErrSandboxGit, nil, "revert the sandbox (exit %d): %s", code, strings.TrimSpace(stderr.String())))
}

// fetchPull runs the pull script and returns the patch. A transfer that
// breaks after the sandbox made its patch is retried once by reading the
// kept copy (an idempotent read).
func (s *Syncer) fetchPull(ctx context.Context, r Runner) (patch []byte, warnings []string, err error) {
	id := newID()
	var stderr bytes.Buffer
	out := &limitedBuffer{max: s.maxBytes + 64, buf: &bytes.Buffer{}}
	code, runErr := r.Run(ctx, pullScript(id, s.maxBytes), nil, out, &limitedBuffer{max: 64 << 10, buf: &stderr})
	msg := strings.TrimSpace(stderr.String())
	if runErr == nil {
		switch code {
		case 0:
		case exitRevert:
			warnings = append(warnings, fmt.Sprintf("the sandbox could not be reset after the pull (%s); the next exec resets it", msg))
		case exitNoGitDir:
			return nil, nil, errdefs.Gone(newError(ErrNoGitDir, nil, "the sandbox has no .git directory: stop this sandbox and start a new one"))
		case exitNoGit:
			return nil, nil, errdefs.Conflict(newError(ErrNoGit, nil, "git is not installed in the sandbox"))
		case exitNoSnapshot:
			return nil, nil, errdefs.Conflict(newError(ErrNoSnapshot, nil, "the sandbox has no sync snapshot, so there is no baseline to pull against: push first"))
		case exitTooLarge:
			if n, err := strconv.ParseInt(msg, 10, 64); err == nil {
				msg = formatBytes(n)
			}
			return nil, nil, errdefs.TooLarge(newError(ErrPatchTooLarge, nil,
				"the sandbox's changes make a patch over the %s limit (%s), so they were not pulled; the sandbox was reset and the patch is kept there until the next exec: get it with `sbx exec --no-sync -- cat %s > sandbox.patch`",
				formatBytes(s.maxBytes), msg, keptPatch))
		case exitDiff, exitGitFailed:
			return nil, nil, errdefs.Unavailable(newError(ErrSandboxGit, nil, "compute the sandbox's changes (exit %d): %s; they were left in the sandbox", code, msg))
		default:
			return nil, nil, errdefs.Unavailable(newError(ErrSandboxGit, nil, "pull the sandbox's changes (exit %d): %s", code, msg))
		}
	}
	patch, ok := parsePull(out)
	if runErr == nil && ok {
		return patch, warnings, nil
	}
	if ctx.Err() != nil {
		return nil, nil, ctx.Err()
	}
	// The transfer broke (or the output is damaged): read the kept copy.
	s.log.Warn("pull transfer incomplete, fetching the kept patch", "err", runErr, "code", code)
	out = &limitedBuffer{max: s.maxBytes + 64, buf: &bytes.Buffer{}}
	stderr.Reset()
	code, err = r.Run(ctx, fetchScript(id), nil, out, &limitedBuffer{max: 64 << 10, buf: &stderr})
	if err == nil && code == 0 {
		if patch, ok := parsePull(out); ok {
			return patch, warnings, nil
		}
	}
	cause := runErr
	if cause == nil {
		cause = err
	}
	if code == exitNoPullPatch {
		return nil, nil, errdefs.Unavailable(newError(ErrTransfer, cause, "the pull did not reach the sandbox (%v): its changes stay there until the next exec resets it; pull again to get them", cause))
	}
	return nil, nil, errdefs.Unavailable(newError(ErrTransfer, cause,
		"the sandbox's changes did not arrive complete (%v); the patch is kept in the sandbox until the next exec: get it with `sbx exec --no-sync -- cat %s > sandbox.patch`", cause, keptPatch))
}

// parsePull checks the header and the size of pull output.
func parsePull(out *limitedBuffer) ([]byte, bool) {
	if out.overflow {
		return nil, false
	}
	b := out.buf.Bytes()
	line, rest, found := bytes.Cut(b, []byte("\n"))
	if !found || !bytes.HasPrefix(line, []byte(pullHeader)) {
		return nil, false
	}
	n, err := strconv.Atoi(string(line[len(pullHeader):]))
	if err != nil || n != len(rest) {
		return nil, false
	}
	return rest, true
}

func newID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

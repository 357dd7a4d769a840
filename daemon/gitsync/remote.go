package gitsync

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/internal/helperproto"
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
	exitRevert      = 88 // only the revert failed
	exitTooLarge    = 89 // the patch is over the limit: its header alone
	exitNoPullPatch = 90
	exitNoGit       = 127
)

// dieExit is how the plain scripts fail: the message on stderr, the code
// as their exit status: each script is its own exec request (or, in the
// helper's exchange, its own process), so its status is that step's.
const dieExit = `die() { [ -z "$2" ] || echo "$2" >&2; exit "$1"; }
`

// preludeChecks finds git and the repository and defines the helpers every
// script uses; it fails through die, which the script defines first. The
// sandbox's PATH may be minimal, so common locations are added (P0 keeps the
// sandbox's own PATH for a user command). safe.directory lets git read a
// checkout owned by another sandbox user; no repository hook runs during
// sync. Every process counts on the hot path, so shell builtins are
// preferred.
const preludeChecks = `P0=$PATH; PATH="$PATH:/usr/local/bin:/usr/bin:/bin"; export PATH
if [ ! -e .git ]; then die 81 "sandboxd: there is no .git in $PWD"; fi
if ! command -v git >/dev/null 2>&1; then die 127 "sandboxd: git is not installed in the sandbox"; fi
g() { git -c safe.directory='*' -c core.hooksPath=/dev/null "$@"; }
if [ -d .git ]; then gd="$PWD/.git"; else gd=$(g rev-parse --absolute-git-dir 2>&1) || die 80 "$gd"; fi
st="$gd/sandboxd"
[ -d "$st" ] || mkdir -p "$st" || die 80 "sandboxd: cannot create $st"
SNAP=` + SnapshotRef + `
BASE=` + BaseRef + `
# revert COMMIT: index and files back to COMMIT, untracked files removed
# (ignored ones, such as build caches, are kept), both refs at COMMIT. The
# sync index goes, and with it what the helper knew of it.
revert() {
	g reset -q --hard "$1" && g clean -fdq &&
	printf 'update %s %s\nupdate %s %s\n' "$SNAP" "$1" "$BASE" "$1" | g update-ref --stdin &&
	rm -f "$st/index" "$st/index.fast" "$st/index.tree"
}
# syncidx: the sync index starts as a copy of the real one, so unchanged
# files are not rehashed.
syncidx() {
	[ ! -f "$st/index" ] || return 0
	rm -f "$st/index.fast" "$st/index.tree"
	[ ! -f "$gd/index" ] || cp "$gd/index" "$st/index"
}
# stageall: the worktree, untracked files included, into the sync index
# (the helper's record that the index is up to date with its answers,
# index.fast, goes: git looked at everything).
stageall() {
	syncidx || return 1
	rm -f "$st/index.fast"
	GIT_INDEX_FILE="$st/index" g add -A
}
`

// prelude starts every plain script.
const prelude = dieExit + preludeChecks

// pushScript first checks that the sandbox holds no unacknowledged edits
// (the pending exec's id is not among acks); if it does, it sends them as
// a pull would and stops (exit 91, or 92 with the header alone when they
// are over max). Otherwise it resets the sandbox to head, applies the patch
// from stdin when there is one, records the snapshot, marks the new exec pend
// as pending (none when pend is empty) and prints the snapshot commit.
func pushScript(head, key string, now time.Time, pend string, acks []string, max int64, large bool) string {
	return prelude + setupEdits + strayEdits(acks, false) + pushBody(head, key, now, pend, acks, max, large, false)
}

// strayEdits runs before a push (or a pull on demand) looks for
// unacknowledged edits. When every exec's edits were pulled (the pending
// exec is acknowledged, or none is pending), the sandbox's checkout must
// hold the tree the last pull left: the snapshot's, plus the last pull's
// patch when it is that exec's. A checkout that differs holds edits no exec
// made or pulled (a file sent with scp, an edit over ssh, a background
// process's output, a shell without sync): the tree the last pull left
// becomes the snapshot and those edits the edits of an exec nobody
// acknowledged, under an id of their own, so they come back like an
// exec's unpulled edits (recover) before anything resets the checkout.
//
// The working tree is staged (c0, the tree the push then moves from) and
// its diff compared with the last pull's patch. Only when they differ is
// the tree the last pull left made and compared with the checkout's.
//
// With preset, the sandbox helper ran this script (the exchange) after its
// native pull against the tree the last pull left (sandboxhelper): its
// environment then holds what that found, x (the tree the last pull left)
// and c1 (the checkout's tree) with sready (the patch is in
// $st/stray.patch), or nothing when it declined; the tree the last pull
// left is then made and the checkout staged on a copy of the sync index,
// whose stage is the helper's. Without preset they are cleared, so
// nothing in the sandbox's environment stands for them.
func strayEdits(acks []string, preset bool) string {
	init := "same=; x=; c1=; sready=; hs=\n"
	if preset {
		init = "same=; x=${x:-}; c1=${c1:-}; sready=${sready:-}; hs=1\n"
	}
	return init + fmt.Sprintf(`sp0=; [ ! -f "$st/pending" ] || read -r sp0 <"$st/pending" || true
sp=$sp0
case ' %[1]s ' in *" $sp "*) sp= ;; esac
c0=
s0=; [ -n "$sp" ] || [ ! -f "$gd/$SNAP" ] || read -r s0 <"$gd/$SNAP" || true
[ -n "$sp" ] || [ -n "$s0" ] || s0=$(g rev-parse -q --verify "$SNAP^{commit}") || s0=
if [ -n "$s0" ]; then
	pid=; [ -z "$sp0" ] || [ ! -f "$st/pull.id" ] || read -r pid <"$st/pull.id" || true
	# The stage the push needs anyway (c0), and its diff, compared with
	# the last pull's patch (the same command made it). Not in the
	# helper's exchange (hs): it stages the sync index itself.
	if [ -z "$x" ] && [ -z "$hs" ]; then
		if stageall && c0=$(GIT_INDEX_FILE="$st/index" g write-tree) &&
			GIT_INDEX_FILE="$st/index" g diff --cached %[2]s "$s0" -- >"$st/stray.patch"; then
			if [ -n "$pid" ] && [ "$pid" = "$sp0" ]; then ! cmp -s "$st/stray.patch" "$st/pull.patch" || same=1
			elif [ ! -s "$st/stray.patch" ]; then same=1; fi
		else c0=; same=1
		fi
	fi
	# They differ: the tree the last pull left (x) and the one the
	# checkout holds (c1) say whether anything else changed.
	if [ -z "$same" ] && [ -z "$x" ]; then
		if [ -n "$pid" ] && [ "$pid" = "$sp0" ] && [ -s "$st/pull.patch" ]; then
			x=$(rm -f "$st/xidx" && GIT_INDEX_FILE="$st/xidx" g read-tree "$s0" &&
				GIT_INDEX_FILE="$st/xidx" g apply --cached --whitespace=nowarn "$st/pull.patch" &&
				GIT_INDEX_FILE="$st/xidx" g write-tree) || x=
			rm -f "$st/xidx"
		else x=$(g rev-parse -q --verify "$s0^{tree}") || x=
		fi
		# In the helper's exchange, staged on a copy of the sync index,
		# so that what the helper knows of it holds.
		if [ -n "$x" ] && [ -n "$hs" ] && [ -z "$c1" ]; then
			syncidx && rm -f "$st/sidx" && cp "$st/index" "$st/sidx" && GIT_INDEX_FILE="$st/sidx" g add -A &&
				c1=$(GIT_INDEX_FILE="$st/sidx" g write-tree) || c1=
			rm -f "$st/sidx"
		fi
	fi
	c1=${c1:-$c0}
	if [ -n "$x" ] && [ -n "$c1" ] && [ "$c1" != "$x" ] &&
		{ u=; [ ! -r /proc/sys/kernel/random/uuid ] || read -r u </proc/sys/kernel/random/uuid || true; } &&
		sh1=$(printf 'sandboxd stray %%s %%s %%s %%s %%s\n' "$gd" "$s0" "$c1" "$$" "$u" | g hash-object --stdin) &&
		sc=$(GIT_AUTHOR_DATE='@0 +0000' GIT_COMMITTER_DATE='@0 +0000' g -c user.name=sandboxd -c user.email=sandboxd@localhost commit-tree "$x" -p "$s0" -m "sandboxd pulled") &&
		g update-ref "$SNAP" "$sc"; then
		echo `+strayIDPrefix+`$(printf %%.40s "$sh1") >"$st/pending" || true
		c0=
	fi
fi
`, strings.Join(acks, " "), strings.Join(diffOptions, " "))
}

// strayIDPrefix starts the id under which edits made in the sandbox by
// anything but an exec come back: only the wording of the report depends
// on it.
const strayIDPrefix = "ed17"

// setupEdits runs before a push looks for unacknowledged edits. A sandbox
// never synced (no snapshot, nothing pending) holds what its setup steps
// made in the checkout (a lockfile, generated code): the first push would
// reset it away. Instead the sandbox's HEAD becomes the snapshot and those
// files the edits of an exec nobody acknowledged, under an id of their own,
// so the push brings them back first, as the RWX CLI's first exec does.
// Only a sandbox without the loose snapshot ref pays git processes, and
// only one whose checkout differs from HEAD pays the round trip back.
const setupEdits = `if [ ! -f "$st/pending" ] && [ ! -f "$gd/${SNAP}" ] && ! g rev-parse -q --verify "$SNAP^{commit}" >/dev/null &&
	[ -n "$(g status --porcelain 2>/dev/null)" ] && h0=$(g rev-parse -q --verify "HEAD^{commit}") &&
	{ u=; [ ! -r /proc/sys/kernel/random/uuid ] || read -r u </proc/sys/kernel/random/uuid || true; } &&
	sh1=$(printf 'sandboxd setup %s %s %s %s\n' "$gd" "$h0" "$$" "$u" | g hash-object --stdin) &&
	sid=` + setupIDPrefix + `$(printf %.40s "$sh1") &&
	g update-ref "$SNAP" "$h0"; then
	echo "$sid" >"$st/pending" || true
fi
`

// setupIDPrefix starts the id under which a sandbox's setup files come
// back (an id is hex): only the wording of the report depends on it.
const setupIDPrefix = "5e7"

// recoveredWhat names what a recovered pull brought back.
func recoveredWhat(id string) string {
	if strings.HasPrefix(id, setupIDPrefix) && len(id) == len(setupIDPrefix)+40 {
		return "the sandbox held files its setup steps made in the checkout"
	}
	if strings.HasPrefix(id, strayIDPrefix) && len(id) == len(strayIDPrefix)+40 {
		return "the sandbox held edits made there outside an exec (over ssh or scp, by a background process or a shell without sync)"
	}
	return "the sandbox held edits of an earlier exec that were never pulled (their pull failed, or the daemon stopped during it)"
}

// pushBody is pushScript after the prelude. The patch, when there is one,
// is on its standard input, and key is patchKey of it ("" for none). With
// helper, the sandbox helper's exchange runs it: its environment holds
// what the helper's stray look and stage found (sready, and hcur, the
// checkout's tree, the user's index already reset to head), and it prints
// the tree the push made in every case, for the helper to adopt.
func pushBody(head, key string, now time.Time, pend string, acks []string, max int64, large, helper bool) string {
	var b strings.Builder
	curFirst := "\nreal=\nif [ -n \"${c0:-}\" ]; then cur=$c0"
	if helper {
		curFirst = " The helper's stage (hcur) also reset the user's index to head.\nreal=\nif [ -n \"${hcur:-}\" ]; then cur=$hcur; real=1"
	}
	big := ""
	if large {
		big = "1"
	}
	fmt.Fprintf(&b, "head=%s\npend=%s\nmax=%d\nacks=' %s '\ntree=\nbig=%s\n", head, pend, max, strings.Join(acks, " "), big)
	fmt.Fprintf(&b, `if [ -f "$st/pending" ]; then
	p=; read -r p <"$st/pending" || true
	case "$acks" in
	*" $p "*) ;;
	*) if snap=$(g rev-parse -q --verify "$SNAP^{commit}"); then
		out="$st/pull.patch"
		# The helper's native pull already made the patch of edits found
		# outside an exec (strayEdits): staging would end what it knows.
		if [ -n "${sready:-}" ] && [ "$(g rev-parse -q --verify "$snap^{tree}")" = "$sready" ]; then cp "$st/stray.patch" "$out" || exit 87
		else stageall && GIT_INDEX_FILE="$st/index" g diff --cached %s "$snap" -- >"$out" || exit 87
		fi
		echo "$p" >"$st/pull.id"
		size=$(($(wc -c <"$out")))
		printf '%s%%s %%d\n' "$p" "$size"
		if [ "$size" -gt "$max" ]; then exit 92; fi
		cat "$out" || exit 87
		exit 91
	fi ;;
	esac
fi
`, strings.Join(diffOptions, " "), pullHeader)
	// The reset fails, touching nothing, when head is missing; only then is
	// it worth a look at why.
	const missing = `	if ! g cat-file -e "$head^{commit}" 2>/dev/null; then echo "sandboxd: commit $head is not in the sandbox" >&2; exit 82; fi
	exit 85
fi
`
	if key != "" {
		// Every process counts here: the refs are written once, at the
		// end, and the sync index starts as a copy of the fresh index.
		date := fmt.Sprintf("@%d +0000", now.Unix())
		// The tree the sandbox must have is made in a scratch index (head
		// plus the patch, no file touched); then the working tree moves
		// from what it is now (one scan) to that tree, touching only the
		// paths that differ, as a checkout does. When that cannot be done,
		// the full reset follows.
		// Reading head's whole tree into an index costs what the tree
		// holds, so head's index is kept (under head's name, written by a
		// rename: a partial copy never carries a name) and copied.
		fmt.Fprintf(&b, `headidx() {
	if [ -f "$st/head-$head.idx" ]; then cp "$st/head-$head.idx" "$st/next"; return; fi
	GIT_INDEX_FILE="$st/next" g read-tree "$head" 2>/dev/null || return 1
	rm -f "$st"/head-*.idx; cp "$st/next" "$st/head.tmp" && mv -f "$st/head.tmp" "$st/head-$head.idx" || true
}
# The same patch on the same head makes the same tree: the last one is
# remembered (an exec run again with nothing changed needs no scratch).
k=; t=; [ ! -f "$st/ptree" ] || read -r k t <"$st/ptree" || true
if [ "$k" = "$head-%[2]s" ] && [ -n "$t" ]; then tree=$t
elif tree=$(headidx && GIT_INDEX_FILE="$st/next" g apply --cached --whitespace=nowarn - && GIT_INDEX_FILE="$st/next" g write-tree); then
	echo "$head-%[2]s $tree" >"$st/ptree" || rm -f "$st/ptree"
else
	rm -f "$st"/head-*.idx "$st/ptree"
	if ! g cat-file -e "$head^{commit}" 2>/dev/null; then echo "sandboxd: commit $head is not in the sandbox" >&2; exit 82; fi
	exit 83
fi
# The tree the working tree holds now: the one strayEdits staged (c0), or
# staged here.%[3]s
elif ! { stageall && cur=$(GIT_INDEX_FILE="$st/index" g write-tree); }; then cur=
fi
# The move: in a large tree by a patch of what differs (it costs what
# changed), else by a two-way read-tree (it costs the whole tree, and one
# process less). Either one refuses a path the working tree changed since
# the index saw it; the full reset follows.
moveto() {
	if [ -n "$big" ]; then
		g diff-tree -p --binary --full-index --no-renames --src-prefix=a/ --dst-prefix=b/ "$1" "$2" >"$st/move.patch" &&
			GIT_INDEX_FILE="$st/index" g apply --index --whitespace=nowarn <"$st/move.patch" 2>/dev/null
	else
		GIT_INDEX_FILE="$st/index" g read-tree -m -u "$1" "$2" 2>/dev/null
	fi
}
if [ -n "$cur" ] && { [ "$cur" = "$tree" ] || moveto "$cur" "$tree"; }; then
	[ -n "$real" ] || g read-tree "$head" || exit 85
	# What a reset clears: a merge, cherry-pick or revert left half done.
	for x in MERGE_HEAD MERGE_MSG MERGE_MODE MERGE_RR SQUASH_MSG CHERRY_PICK_HEAD REVERT_HEAD AUTO_MERGE; do
		[ ! -e "$gd/$x" ] || rm -f "$gd/$x"
	done
else
	revert "$head" && cp "$gd/index" "$st/index" || exit 85
	GIT_INDEX_FILE="$st/index" g read-tree --reset -u "$head" "$tree" || { rm -f "$st/ptree"; revert "$head"; exit 83; }
fi
if snap=$(GIT_AUTHOR_DATE=%[1]q GIT_COMMITTER_DATE=%[1]q g -c user.name=sandboxd -c user.email=sandboxd@localhost commit-tree "$tree" -p "$head" -m "sandboxd sync") &&
	printf 'update HEAD %%s\nupdate %%s %%s\nupdate %%s %%s\n' "$head" "$SNAP" "$snap" "$BASE" "$head" | g update-ref --stdin; then :
else
	revert "$head"; exit 84
fi
`, date, key, curFirst)
	} else {
		b.WriteString(`if ! revert "$head"; then
` + missing + "snap=$head\n")
	}
	// The helper adopts the tree the push made: it needs it also when no
	// patch made one.
	if helper {
		b.WriteString(`[ -n "$tree" ] || tree=$(g rev-parse "$head^{tree}") || tree=
`)
	}
	// The snapshot, then the tree the checkout holds.
	b.WriteString(`if [ -n "$pend" ]; then echo "$pend" >"$st/pending" || exit 84; else rm -f "$st/pending"; fi
echo "$snap"; echo "${tree:-}"
`)
	return b.String()
}

// pullHeader starts the pull output: the exec's id and the patch's size
// follow, so a truncated transfer is noticed.
const pullHeader = helperproto.PullHeader

// pullScript writes the sandbox's changes since the snapshot to
// $st/pull.patch (kept until the next pull, tagged with the exec's id in
// $st/pull.id, so a broken transfer can be fetched again) and prints the
// header and the patch. The sandbox keeps its files.
// Run on its own (not after a push), it first finds edits made outside an
// exec (strayEdits); when every exec's edits were pulled and there are
// none, it answers an empty patch.
func pullScript(acks []string, max int64) string {
	return prelude + strayEdits(acks, false) + fmt.Sprintf(`p=; [ ! -f "$st/pending" ] || read -r p <"$st/pending" || true
case ' %s ' in *" $p "*) p= ;; esac
if [ -z "$p" ]; then
	g rev-parse -q --verify "$SNAP^{commit}" >/dev/null || { echo "sandboxd: no sync snapshot: nothing was pushed" >&2; exit 86; }
	printf '%snone 0\n'; exit 0
fi
`, strings.Join(acks, " "), pullHeader) + pullBody(max, false)
}

// pullBody is the pull after the prelude: the sync index staged, its
// diff against the snapshot kept in $st/pull.patch and named by the
// exec's id in $st/pull.id. With helper, the sandbox helper's exchange
// runs it: the index is as the helper staged it when hstaged is set, and
// the helper sends the patch; else it prints the header and the patch.
func pullBody(max int64, helper bool) string {
	stage := `{ syncidx && rm -f "$st/index.fast" && GIT_INDEX_FILE="$st/index" g add -A; }`
	if helper {
		stage = `{ [ -n "${hstaged:-}" ] || ` + stage + `; }`
	}
	body := fmt.Sprintf(`snap=$(g rev-parse -q --verify "$SNAP^{commit}") || { echo "sandboxd: no sync snapshot: nothing was pushed" >&2; exit 86; }
id=none; [ ! -f "$st/pending" ] || read -r id <"$st/pending" || true
out="$st/pull.patch"
echo >"$st/pull.id"
{ %s && GIT_INDEX_FILE="$st/index" g diff --cached %s "$snap" -- >"$out"; } || exit 87
echo "$id" >"$st/pull.id"
`, stage, strings.Join(diffOptions, " "))
	if helper {
		return body
	}
	return body + fmt.Sprintf(`size=0; [ ! -s "$out" ] || size=$(($(wc -c <"$out")))
printf '%s%%s %%d\n' "$id" "$size"
if [ "$size" -gt %d ]; then exit 89; fi
[ "$size" -eq 0 ] || cat "$out" || exit 87
`, pullHeader, max)
}

// keptPatch is where the sandbox keeps the last pull's patch.
const keptPatch = ".git/sandboxd/pull.patch"

// fetchScript prints the kept pull patch again if it is exec id's.
func fetchScript(id string) string {
	return prelude + fmt.Sprintf(`kept=; read -r kept <"$st/pull.id" || true
[ "$kept" = %s ] || exit 90
printf '%s%%s %%d\n' "$kept" "$(($(wc -c <"$st/pull.patch")))"
cat "$st/pull.patch"
`, shellWord(id), pullHeader)
}

// revertScript returns the sandbox to its base commit and forgets any
// pending edits.
const revertScript = prelude + `base=$(g rev-parse -q --verify "$BASE^{commit}") || base=$(g rev-parse -q --verify "HEAD^{commit}") || exit 80
revert "$base" || exit 88
rm -f "$st/pending"
`

// Exit codes of the push script beyond the shared ones.
const (
	exitUnpulled         = 91
	exitUnpulledTooLarge = 92
)

// Push makes the sandbox's working tree equal to the one p was prepared
// from: it pushes p.HeadSHA with git's protocol when the sandbox may lack
// it, then in one Runner call resets the sandbox to p.HeadSHA (cleaning
// whatever happened there since the last exec), applies p, and records the
// synced tree as SnapshotRef, the baseline of the next Pull.
//
// When the sandbox still holds the edits of an exec that was never pulled
// to the end, they are pulled first (applied, or saved and reported); if
// that changed the local working tree the result says Again: the caller
// prepares and pushes again.
func (s *Syncer) Push(ctx context.Context, r Runner, p *Patch) (PushResult, error) {
	var res PushResult
	if p != nil && p.early != nil {
		// Made for an exchange: its patch is computed behind it.
		if err := p.early.wait(ctx); err != nil {
			return res, err
		}
	}
	if err := s.checkPatch(p); err != nil {
		return res, err
	}
	start := time.Now()
	rp, err := s.openRepo(ctx, p.RepoRoot)
	if err != nil {
		return res, repoError(err)
	}
	if err := s.pushCommitsIfNeeded(ctx, r, rp, p, &res); err != nil {
		return res, err
	}
	pend := ""
	if !p.PushOnly {
		pend = newID()
	}
	for attempt := 0; ; attempt++ {
		var stdout, stderr bytes.Buffer
		var stdin io.Reader
		if len(p.Data) > 0 {
			stdin = bytes.NewReader(p.Data)
		}
		out := &limitedBuffer{max: s.maxBytes + 64, buf: &stdout}
		code, err := r.Run(ctx, pushScript(p.HeadSHA, patchKey(p.Data), s.now(), pend, s.acks(rp), s.maxBytes, p.LargeTree), stdin, out, &limitedBuffer{max: 64 << 10, buf: &stderr})
		if err != nil {
			return res, errdefs.Unavailable(fmt.Errorf("push your changes to the sandbox: %w", err))
		}
		if code == 0 {
			snap, _, _ := strings.Cut(strings.TrimSpace(stdout.String()), "\n")
			if !shaPattern.MatchString(snap) {
				snap = ""
			}
			s.pushDone(p, pend, snap, &res)
			s.log.Debug("sync pushed", "bytes", res.Bytes, "files", res.Files, "commits", res.Commits, "snapshot", res.Snapshot, "took", time.Since(start))
			return res, nil
		}
		again, err := s.pushFailed(ctx, r, rp, p, code, out, sandboxText(stderr.String()), attempt, &res)
		if err != nil || again {
			return res, err
		}
	}
}

// checkPatch refuses a push without a prepared patch or over the limit.
func (s *Syncer) checkPatch(p *Patch) error {
	if p == nil || !shaPattern.MatchString(p.HeadSHA) {
		return errdefs.Invalid(fmt.Errorf("push: no prepared patch with a head commit"))
	}
	// An early patch's data may not be there yet; its computation bounds
	// it.
	if p.early == nil && int64(len(p.Data)) > s.maxBytes {
		return errdefs.TooLarge(newError(ErrPatchTooLarge, nil, "the sync patch is %s, over the %s limit: commit and push large files, or add them to .gitignore, or use --no-sync", formatBytes(int64(len(p.Data))), formatBytes(s.maxBytes)))
	}
	return nil
}

// pushCommitsIfNeeded sends p's head with git's protocol unless the sandbox
// is known to have it.
func (s *Syncer) pushCommitsIfNeeded(ctx context.Context, r Runner, rp repo, p *Patch, res *PushResult) error {
	if p.HeadSHA == p.BaseSHA || s.knownPushed(p.Sandbox, p.HeadSHA) {
		return nil
	}
	if err := s.pushCommits(ctx, r, rp, p.HeadSHA); err != nil {
		return err
	}
	res.Commits = true
	return nil
}

// pushDone records a successful push of p in res.
func (s *Syncer) pushDone(p *Patch, pend, snapshot string, res *PushResult) {
	s.remember(p.Sandbox, p.HeadSHA)
	res.Pending = pend
	res.Snapshot = snapshot
	if p.early != nil && !p.early.finished() {
		// Computed behind the exchange, which does not wait for it.
		res.Files = len(p.early.entries)
		return
	}
	res.Bytes, res.Files = len(p.Data), len(p.Files)
}

// pushFailed handles a push script that did not succeed (exit code, its
// output and its stderr msg). Unpulled edits of an earlier exec are brought
// back; a missing base commit is pushed. It returns again when the caller
// must prepare and push anew (the local tree changed), nil error and false
// when the same push may be retried, or the error to report.
func (s *Syncer) pushFailed(ctx context.Context, r Runner, rp repo, p *Patch, code int, out *limitedBuffer, msg string, attempt int, res *PushResult) (again bool, err error) {
	switch code {
	case exitUnpulled, exitUnpulledTooLarge:
		if attempt > 1 {
			return false, errdefs.Unavailable(newError(ErrSandboxGit, nil, "the sandbox keeps reporting edits that were not pulled: run `nook reset` if this persists"))
		}
		pr, changed, err := s.recover(ctx, r, rp, out, code == exitUnpulledTooLarge)
		res.Recovered = pr
		res.Warnings = append(res.Warnings, pr.Warnings...)
		if err != nil {
			return false, err
		}
		res.Again = changed
		return changed, nil
	case exitNoBase:
		if res.Commits || attempt > 0 {
			return false, errdefs.Conflict(newError(ErrBaseMissing, nil,
				"the sandbox does not have commit %s even after a git push to it: run `nook reset`, or use --no-sync", short(p.HeadSHA)))
		}
		s.forget(p.Sandbox)
		if err := s.pushCommits(ctx, r, rp, p.HeadSHA); err != nil {
			return false, err
		}
		res.Commits = true
		return false, nil
	case exitNoGitDir:
		return false, errdefs.Gone(newError(ErrNoGitDir, nil, "the sandbox has no .git directory, so your changes cannot be synced: stop this sandbox and start a new one"))
	case exitNoGit:
		return false, errdefs.Conflict(newError(ErrNoGit, nil, "git is not installed in the sandbox: add a task that installs git before the sandbox task, or use --no-sync"))
	case exitApply:
		return false, errdefs.Conflict(newError(ErrApplyFailed, nil, "your changes did not apply in the sandbox (it was reset to %s): %s; run `nook reset` if this persists", short(p.HeadSHA), msg))
	default:
		return false, errdefs.Unavailable(newError(ErrSandboxGit, nil, "push your changes to the sandbox: %s (exit %d): %s", pushStep(code), code, msg))
	}
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
// files reset, untracked files removed (ignored ones kept), index reset,
// pending edits forgotten.
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
	return errdefs.Unavailable(newError(ErrSandboxGit, nil, "revert the sandbox (exit %d): %s", code, sandboxText(stderr.String())))
}

// fetchPull runs the pull script and returns the exec's id and its patch.
// A transfer that breaks after the sandbox made its patch is retried once by
// reading the kept copy (an idempotent read). A patch over the size limit
// is streamed to a file under <git dir>/sandboxd/pulls/ instead (saved).
func (s *Syncer) fetchPull(ctx context.Context, r Runner, rp repo) (id string, patch []byte, saved string, err error) {
	var stderr bytes.Buffer
	out := &limitedBuffer{max: s.maxBytes + 128, buf: &bytes.Buffer{}}
	code, runErr := r.Run(ctx, pullScript(s.acks(rp), s.maxBytes), nil, out, &limitedBuffer{max: 64 << 10, buf: &stderr})
	if runErr == nil && code != 0 {
		return s.pullFailed(ctx, r, rp, code, out, sandboxText(stderr.String()))
	}
	return s.pullOutput(ctx, r, rp, out, code, runErr)
}

// pullFailed explains a pull script that failed with code (out is its
// output, msg its stderr). Only a patch over the limit is fetched, to a file.
func (s *Syncer) pullFailed(ctx context.Context, r Runner, rp repo, code int, out *limitedBuffer, msg string) (id string, patch []byte, saved string, err error) {
	switch code {
	case exitNoGitDir:
		return "", nil, "", errdefs.Gone(newError(ErrNoGitDir, nil, "the sandbox has no .git directory: stop this sandbox and start a new one"))
	case exitNoGit:
		return "", nil, "", errdefs.Conflict(newError(ErrNoGit, nil, "git is not installed in the sandbox"))
	case exitNoSnapshot:
		return "", nil, "", errdefs.Conflict(newError(ErrNoSnapshot, nil, "the sandbox has no sync snapshot, so there is no baseline to pull against: push first"))
	case exitTooLarge:
		id, size, ok := parseHeader(out.buf.Bytes())
		if !ok {
			return "", nil, "", errdefs.Unavailable(newError(ErrTransfer, nil, "the sandbox's answer to the pull does not name a valid exec (something in the sandbox wrote .git/sandboxd/pending?): its changes were not pulled and stay in the sandbox; `nook reset` drops them"))
		}
		saved, err := s.fetchToFile(ctx, r, rp, id, size)
		if err != nil {
			return "", nil, "", errdefs.TooLarge(newError(ErrPatchTooLarge, err,
				"the sandbox's changes make a patch over the %s limit (%s), so they were not pulled, and copying them here failed (%v); they stay in the sandbox (its files and %s) until an exec after the next one",
				formatBytes(s.maxBytes), formatBytes(size), err, keptPatch))
		}
		return id, nil, saved, errdefs.TooLarge(newError(ErrPatchTooLarge, nil,
			"the sandbox's changes make a patch over the %s limit (%s), so they were not applied; the patch is saved at %s (apply what you need with `git apply --3way %s`)",
			formatBytes(s.maxBytes), formatBytes(size), saved, saved))
	case exitDiff, exitGitFailed:
		return "", nil, "", errdefs.Unavailable(newError(ErrSandboxGit, nil, "compute the sandbox's changes (exit %d): %s; they were left in the sandbox and the next exec brings them back", code, msg))
	default:
		return "", nil, "", errdefs.Unavailable(newError(ErrSandboxGit, nil, "pull the sandbox's changes (exit %d): %s; they were left in the sandbox and the next exec brings them back", code, msg))
	}
}

// pullOutput reads a pull's output (header and patch). A transfer that
// broke after the sandbox made its patch (runErr, or damaged output) is
// retried once by reading the kept copy (an idempotent read).
func (s *Syncer) pullOutput(ctx context.Context, r Runner, rp repo, out *limitedBuffer, code int, runErr error) (id string, patch []byte, saved string, err error) {
	id, patch, ok := parsePull(out)
	if runErr == nil && ok {
		return id, patch, "", nil
	}
	if ctx.Err() != nil {
		return "", nil, "", ctx.Err()
	}
	// The transfer broke (or the output is damaged): read the kept copy.
	s.log.Warn("pull transfer incomplete, fetching the kept patch", "err", runErr, "code", code)
	cause := runErr
	if cause == nil {
		cause = fmt.Errorf("damaged output (exit %d)", code)
	}
	if id == "" {
		// Not even the header arrived: the next exec's push brings the
		// edits back, as after a crash.
		return "", nil, "", errdefs.Unavailable(newError(ErrTransfer, cause, "the sandbox's changes did not arrive (%v): they stay in the sandbox and the next exec brings them back first", cause))
	}
	var stderr bytes.Buffer
	out = &limitedBuffer{max: s.maxBytes + 128, buf: &bytes.Buffer{}}
	code, err = r.Run(ctx, fetchScript(id), nil, out, &limitedBuffer{max: 64 << 10, buf: &stderr})
	if err == nil && code == 0 {
		if id2, patch, ok := parsePull(out); ok && id2 == id {
			return id, patch, "", nil
		}
	}
	return "", nil, "", errdefs.Unavailable(newError(ErrTransfer, cause,
		"the sandbox's changes did not arrive complete (%v): they stay in the sandbox and the next exec brings them back first", cause))
}

// fetchToFile streams the kept pull patch of exec id into a new file under
// <git dir>/sandboxd/pulls/. The file's name is the daemon's own (a time and
// a random id), never the sandbox's. The copy is bounded: by the size the
// header stated, and at most MaxSavedPatchBytes (a patch stated larger is
// not copied at all; one that grows past what it stated is cut off, and
// the partial file removed); and by a deadline of its own, so that it ends
// even when its caller's context was detached to outlive the caller. Over
// a bound nothing is acknowledged: the sandbox keeps the edits.
func (s *Syncer) fetchToFile(ctx context.Context, r Runner, rp repo, id string, size int64) (string, error) {
	if !validPullID(id) || id == noPullID {
		return "", errors.New("no valid exec id in the sandbox's answer")
	}
	if size > s.maxSaved {
		return "", fmt.Errorf("the sandbox states a patch of %s, over the %s a saved patch may be (fetch it yourself: it is the sandbox's %s; or `nook reset` to drop it)",
			formatBytes(size), formatBytes(s.maxSaved), keptPatch)
	}
	dir := filepath.Join(rp.stateDir(), "pulls")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	name := filepath.Join(dir, s.now().UTC().Format("20060102T150405Z")+"-"+newID()[:12]+".patch")
	f, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return "", err
	}
	deadline := s.saveDeadline(size)
	ctx, cancel := context.WithTimeout(ctx, deadline)
	defer cancel()
	hw := &headerSkipper{w: f, id: id, max: size, stop: cancel}
	var stderr bytes.Buffer
	code, err := r.Run(ctx, fetchScript(id), nil, hw, &limitedBuffer{max: 64 << 10, buf: &stderr})
	cerr := f.Close()
	switch msg := sandboxText(stderr.String()); {
	case hw.err != nil:
		err = hw.err
	case err != nil && ctx.Err() == context.DeadlineExceeded:
		err = fmt.Errorf("the copy took longer than its %s deadline: %w", deadline, err)
	case err != nil:
	case code == exitNoPullPatch:
		err = fmt.Errorf("the sandbox no longer keeps exec %s's patch: another exec's replaced it", id)
	case code != 0 && msg == "":
		err = fmt.Errorf("the fetch script exited %d", code)
	case code != 0:
		err = fmt.Errorf("the fetch script exited %d: %s", code, msg)
	}
	if err == nil {
		err = cerr
	}
	if err == nil && hw.written != hw.size {
		err = fmt.Errorf("%d of %d bytes arrived", hw.written, hw.size)
	}
	if err != nil {
		_ = os.Remove(name)
		return "", err
	}
	return name, nil
}

// saveDeadline bounds the copy of a saved patch of size bytes: a minute
// (saveWait), plus a second for each MiB.
func (s *Syncer) saveDeadline(size int64) time.Duration {
	return s.saveWait + time.Duration(size>>20)*time.Second
}

// headerSkipper writes what follows the first line (the pull header, which
// must name exec id) and at most the size the header states, and no more
// than max, the size stated before. Past a bound it records err and calls
// stop, which ends the remote command.
type headerSkipper struct {
	w       io.Writer
	id      string
	max     int64
	stop    func()
	line    []byte
	past    bool
	size    int64
	written int64
	err     error
}

func (h *headerSkipper) fail(err error) (int, error) {
	if h.err == nil {
		h.err = err
		h.stop()
	}
	return 0, err
}

func (h *headerSkipper) Write(p []byte) (int, error) {
	n := len(p)
	if h.err != nil {
		return 0, h.err
	}
	if !h.past {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			if len(h.line)+len(p) > maxHeaderLine {
				return h.fail(errors.New("the sandbox's answer has no valid header"))
			}
			h.line = append(h.line, p...)
			return n, nil
		}
		h.line = append(h.line, p[:i+1]...)
		h.past = true
		id, size, ok := parseHeader(h.line)
		switch {
		case !ok || id != h.id:
			return h.fail(fmt.Errorf("the sandbox's answer does not name exec %s's patch", h.id))
		case size > h.max:
			return h.fail(fmt.Errorf("the sandbox's patch grew to %s since it stated %s: not copied", formatBytes(size), formatBytes(h.max)))
		}
		h.size = size
		p = p[i+1:]
	}
	if int64(len(p)) > h.size-h.written {
		return h.fail(fmt.Errorf("the sandbox sent more than the %s its patch has: the copy was stopped", formatBytes(h.size)))
	}
	w, err := h.w.Write(p)
	h.written += int64(w)
	if err != nil {
		return h.fail(err)
	}
	return n, nil
}

// maxHeaderLine bounds the pull header line.
const maxHeaderLine = 256

// noPullID is the id a pull names when the sandbox has no pending exec.
const noPullID = "none"

// validPullID accepts the ids the daemon makes (newID: hex) and noPullID:
// an id from the sandbox names nothing else, and never a local path.
func validPullID(id string) bool { return id == noPullID || isID(id) }

// parseHeader reads "sandboxd-pull <id> <size>\n".
func parseHeader(b []byte) (id string, size int64, ok bool) {
	line, _, found := bytes.Cut(b, []byte("\n"))
	rest, has := bytes.CutPrefix(line, []byte(pullHeader))
	if !found || !has {
		return "", 0, false
	}
	if len(line) > maxHeaderLine {
		return "", 0, false
	}
	f := strings.Fields(string(rest))
	if len(f) != 2 || !validPullID(f[0]) {
		return "", 0, false
	}
	n, err := strconv.ParseInt(f[1], 10, 64)
	if err != nil || n < 0 {
		return "", 0, false
	}
	return f[0], n, true
}

// parsePull checks the header and the size of pull output.
func parsePull(out *limitedBuffer) (id string, patch []byte, ok bool) {
	id, n, ok := parseHeader(out.buf.Bytes())
	if !ok {
		return "", nil, false
	}
	if out.overflow {
		return id, nil, false
	}
	_, rest, _ := bytes.Cut(out.buf.Bytes(), []byte("\n"))
	if n != int64(len(rest)) {
		return id, nil, false
	}
	return id, rest, true
}

// shellWord quotes s for sh.
func shellWord(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

func newID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// HelperRunner is a Runner that can offer the sandbox helper (package
// sandboxhelper) on its connection: its installed file name under
// .git/sandboxd/bin and its server's instance, or "" while there is none.
type HelperRunner interface {
	SyncHelper() (name, instance string)
}

// syncHelper is r's sandbox helper when it names a valid one, else "".
func syncHelper(r Runner) (name, inst string) {
	h, ok := r.(HelperRunner)
	if !ok {
		return "", ""
	}
	name, inst = h.SyncHelper()
	if !helperName.MatchString(name) || !helperInstance.MatchString(inst) {
		return "", ""
	}
	return name, inst
}

var (
	helperName     = regexp.MustCompile(`^[a-z-]+-[0-9a-f]{16}$`)
	helperInstance = regexp.MustCompile(`^[0-9a-f]{8,64}$`)
)

// InCheckout is body run as the sync scripts run: in the checkout, with
// git found, $gd the git directory and $st sandboxd's state directory in
// it; it fails with the scripts' exit codes (81: no .git, 127: no git).
func InCheckout(body string) string { return prelude + body }

// patchKey names a patch in the sandbox's cache of the tree it makes
// (.git/sandboxd/ptree): its SHA-256, "" for no patch.
func patchKey(patch []byte) string {
	if len(patch) == 0 {
		return ""
	}
	h := sha256.Sum256(patch)
	return hex.EncodeToString(h[:])
}

// WithHelper is r offering the sandbox helper name/inst (HelperRunner):
// the caller asked for it once, before the exec, so the sync never asks
// back.
func WithHelper(r Runner, name, inst string) Runner {
	return helperRunner{Runner: r, name: name, inst: inst}
}

type helperRunner struct {
	Runner
	name, inst string
}

// WithRelay is r, made by WithHelper, running its held exchanges through
// er when er can take them.
func WithRelay(r Runner, er ExchangeRunner) Runner {
	h, ok := r.(helperRunner)
	if !ok {
		return r
	}
	return relayRunner{helperRunner: h, er: er}
}

type relayRunner struct {
	helperRunner
	er ExchangeRunner
}

func (r relayRunner) RunExchange(ctx context.Context, x RelayedExchange, stdin io.Reader, stdout, stderr io.Writer) (int, bool, error) {
	return r.er.RunExchange(ctx, x, stdin, stdout, stderr)
}

func (h helperRunner) SyncHelper() (string, string) { return h.name, h.inst }

// RunPreamble sends the preamble beside the exec request when r can.
func (h helperRunner) RunPreamble(ctx context.Context, command string, preamble []byte, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	if p, ok := h.Runner.(PreambleRunner); ok {
		return p.RunPreamble(ctx, command, preamble, stdin, stdout, stderr)
	}
	in := io.Reader(bytes.NewReader(preamble))
	if stdin != nil {
		in = io.MultiReader(in, stdin)
	}
	return h.Runner.Run(ctx, command, in, stdout, stderr)
}

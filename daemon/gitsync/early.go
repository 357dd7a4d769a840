package gitsync

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/sandboxd/sandboxd/internal/gitobj"
	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// The early request: an exchange's request leaves before git computed the
// patch. The sandbox helper's native push takes the request's entries
// (every path that may differ from HEAD, with its mode, blob id and
// content), and needs the patch only when it declines; so for an
// incremental Prepare the entries are made in-process from the paths the
// tracker named and those of the last diff, the request goes out, and the
// sync index's staging and diff (stageIncremental, unchanged) run
// meanwhile. The patch follows the request in a Patch frame
// (helperproto.FramePatch), which the helper reads only for the plain
// push. Once git is done, the entries are checked against what it staged:
// a disagreement turns the early request off for the repository until its
// configuration or rules change.
//
// It is taken only where hashing a file as it is gives what git add
// stores: no attributes file that can apply mentions a conversion
// (helperproto.ConvertingAttribute), core.autocrlf unset or false, no
// core.attributesFile. And only where the entries can name every path
// that differs: HEAD did not move, no directory appeared or went away.

// earlyPatch is what a Patch made by PrepareExchange's early way carries
// until its data is computed.
type earlyPatch struct {
	entries []helperproto.PushEntry
	// bundle is entries as the request carries them (nativeBundle).
	bundle string
	plan   *incPlan
	// stamps are the versions of the files read for entries.
	stamps map[string]stamp
	done   chan struct{}
	// Once done is closed: err says the patch was not computed (the
	// Patch's Data and Files are unset); mismatch that the entries
	// disagree with git's staging.
	err, mismatch error
}

// wait waits for the patch: the background diff's git processes end with
// the exec's context, so does this wait with ctx.
func (e *earlyPatch) wait(ctx context.Context) error {
	select {
	case <-e.done:
		return e.err
	case <-ctx.Done():
		return fmt.Errorf("wait for the sync patch git computes: %w", ctx.Err())
	}
}

// finished says the patch's computation ended (its data may be read).
func (e *earlyPatch) finished() bool {
	select {
	case <-e.done:
		return true
	default:
		return false
	}
}

// PrepareExchange is Prepare for an exec the caller runs as one exchange
// (Fuse) on r. When r offers the sandbox helper and the change tracker
// names what changed, the returned Patch may be early: its exchange's
// request leaves at once and its patch follows (see early.go). Every other
// case is Prepare's.
func (s *Syncer) PrepareExchange(ctx context.Context, r Runner, repoRoot, baseSHA string) (*Patch, error) {
	_, helper := sideOf(r).(helperSide)
	return s.prepare(ctx, repoRoot, baseSHA, helper)
}

// earlyEntries are the native push's entries of an incremental Prepare
// planned as pl, made before git stages anything: the paths of the last
// diff the tracker did not name, as git staged them then (checked against
// the files), and the paths planned, read from the working tree (a
// missing or ignored one removed). ok is false whenever git could see the
// tree otherwise, or the entries would be over MaxFusedPatch: the request
// then waits for the patch.
func (s *Syncer) earlyEntries(r repo, st *prepState, head string, pl *incPlan) (*earlyPatch, bool) {
	if !st.plain || st.earlyOff || pl.dirs || head != st.head || st.res == nil || len(st.res.lfs) > 0 {
		return nil, false
	}
	// want: the mode and blob a path must have (from the last diff), or
	// remove; read: read it from the working tree.
	type plan struct {
		remove bool
		mode   uint32
		oid    string
	}
	paths := map[string]plan{}
	for _, rec := range st.res.recs {
		switch rec.status {
		case 'D':
			paths[rec.src] = plan{remove: true}
			continue
		case 'R':
			paths[rec.src] = plan{remove: true}
		case 'A', 'M', 'T':
		default:
			return nil, false
		}
		mode, err := parseMode(rec.dstMode)
		if err != nil {
			return nil, false
		}
		paths[rec.dst] = plan{mode: mode, oid: rec.dstSHA}
	}
	for _, p := range pl.feed {
		paths[p] = plan{remove: !pl.exists[p]}
	}
	for _, p := range append(append([]string{}, pl.forceRemove...), pl.ignored...) {
		paths[p] = plan{remove: true}
	}
	ea := &earlyPatch{plan: pl, stamps: map[string]stamp{}, done: make(chan struct{})}
	var removes, writes []helperproto.PushEntry
	size := 0
	for _, p := range sortedKeys(paths) {
		want := paths[p]
		if !utf8.ValidString(p) || !helperproto.ValidPath(p) {
			return nil, false
		}
		if want.remove {
			removes = append(removes, helperproto.PushEntry{Path: p})
			continue
		}
		abs := filepath.Join(r.root, filepath.FromSlash(p))
		fi, err := os.Lstat(abs)
		if err != nil || size+int(fi.Size())+len(p) > MaxFusedPatch {
			return nil, false
		}
		mode, ok := gitobj.ModeOf(fi)
		if !ok {
			return nil, false
		}
		ea.stamps[p] = stampOf(abs)
		var data []byte
		if mode == gitobj.ModeSymlink {
			var t string
			t, err = os.Readlink(abs)
			data = []byte(t)
		} else {
			data, err = os.ReadFile(abs)
		}
		if err != nil || (mode != gitobj.ModeSymlink && int64(len(data)) != fi.Size()) {
			return nil, false
		}
		size += len(data) + len(p)
		oid := gitobj.HashObject("blob", data).String()
		if want.oid != "" && (want.mode != mode || want.oid != oid) {
			// Changed since the last diff though the tracker did not say.
			return nil, false
		}
		if data == nil {
			data = []byte{}
		}
		writes = append(writes, helperproto.PushEntry{Path: p, Mode: mode, OID: oid, Data: data})
	}
	// Removals first: a path removed and one written below it (a file
	// that became a directory) end as git's index ends.
	ea.entries = append(removes, writes...)
	if converts(r, ea.entries) {
		return nil, false
	}
	b, err := json.Marshal(ea.entries)
	if err != nil {
		return nil, false
	}
	ea.bundle = string(b)
	return ea, true
}

func parseMode(s string) (uint32, error) {
	var m uint32
	if _, err := fmt.Sscanf(s, "%o", &m); err != nil {
		return 0, err
	}
	switch m {
	case gitobj.ModeFile, gitobj.ModeExec, gitobj.ModeSymlink:
		return m, nil
	}
	return 0, fmt.Errorf("mode %s", s)
}

// converts says an attributes file that can apply to the entries' paths
// sets an attribute under which git add may store a file otherwise than
// as it is (line ends, a filter, an encoding): the repository's
// info/attributes, the user's and the system's, and the .gitattributes of
// every directory on the way to a path. A file that cannot be read counts
// as one that converts.
func converts(r repo, entries []helperproto.PushEntry) bool {
	files := []string{filepath.Join(r.gitDir, "info", "attributes")}
	if b, err := os.ReadFile(filepath.Join(r.gitDir, "commondir")); err == nil {
		c := string(bytes.TrimSpace(b))
		if !filepath.IsAbs(c) {
			c = filepath.Join(r.gitDir, c)
		}
		files = append(files, filepath.Join(c, "info", "attributes"))
	}
	if x := os.Getenv("XDG_CONFIG_HOME"); x != "" {
		files = append(files, filepath.Join(x, "git", "attributes"))
	} else if h := os.Getenv("HOME"); h != "" {
		files = append(files, filepath.Join(h, ".config", "git", "attributes"))
	}
	if os.Getenv("GIT_ATTR_NOSYSTEM") == "" {
		files = append(files, "/etc/gitattributes")
	}
	dirs := map[string]bool{}
	for _, e := range entries {
		for d := path.Dir(e.Path); !dirs[d]; d = path.Dir(d) {
			dirs[d] = true
			files = append(files, filepath.Join(r.root, filepath.FromSlash(d), ".gitattributes"))
			if d == "." {
				break
			}
		}
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
			continue
		}
		if err != nil || helperproto.ConvertingAttribute(b) != "" {
			return true
		}
	}
	return false
}

// newEarlyPatch is the Patch of an early request; finishEarly fills in
// its data.
func (s *Syncer) newEarlyPatch(r repo, baseSHA, head string, ea *earlyPatch, start time.Time) *Patch {
	p := &Patch{RepoRoot: r.root, BaseSHA: baseSHA, HeadSHA: head, early: ea}
	if fi, err := os.Stat(r.index); err == nil && fi.Size() >= s.largeIndex {
		p.LargeTree = true
	}
	var added []string
	for _, u := range ea.plan.untracked {
		if ea.stamps[u].path != "" {
			added = append(added, u)
		}
	}
	if w := unresolvedWarning(r, added); w != "" {
		p.Warnings = append(p.Warnings, w)
	}
	if s.observe != nil {
		s.observe("early")
	}
	s.log.Debug("sync patch prepared", "repo", r.root, "how", "early", "entries", len(ea.entries), "took", time.Since(start))
	return p
}

// earlyPatchTimeout bounds computing the patch behind an early request,
// which outlives its exec.
const earlyPatchTimeout = 5 * time.Minute

// finishEarly computes the patch of an early request p while the request
// travels (stageIncremental, as an incremental Prepare does), checks the
// entries sent against git's staging, then releases st (the next Prepare
// of the repository waits for it) and closes the patch's done. A failure
// leaves st invalid: the next Prepare scans the whole tree.
func (s *Syncer) finishEarly(ctx context.Context, r repo, head string, st *prepState, p *Patch) {
	ea := p.early
	start := time.Now()
	defer close(ea.done)
	defer st.mu.Unlock()
	res, err := s.stageIncremental(ctx, r, st, head, ea.plan)
	if err == nil && s.verify {
		err = s.verifyFull(ctx, r, head, res)
	}
	if err != nil {
		st.valid = false
		ea.err = fmt.Errorf("compute the sync patch: %w", err)
		s.log.Debug("the sync patch behind an early request failed; the next sync scans the whole tree", "repo", r.root, "err", err)
		return
	}
	if err := checkEarly(st, head, ea, res); err != nil {
		ea.mismatch = err
		if errors.Is(err, errRace) {
			s.log.Debug("a file changed while the early request was made", "repo", r.root, "err", err)
		} else {
			st.earlyOff = true
			s.log.Warn("an early sync request disagreed with git's staging (a filter or line-end conversion?); this repository's requests wait for the patch until its configuration or attributes change",
				"repo", r.root, "err", err)
		}
	}
	p.Data, p.Files, p.recs = res.data, append([]string{}, res.files...), res.recs
	s.log.Debug("sync patch computed behind the request", "repo", r.root, "files", len(p.Files), "bytes", len(p.Data), "took", time.Since(start))
}

// errRace: a file changed between its read for the entries and git's
// staging.
var errRace = errors.New("a file changed while it was synced")

// checkEarly checks an early request's entries against git's staging of
// the same paths into the sync index: a write holds the mode and blob git
// staged, a removal is absent from it, and every path git's diff names
// has an entry. Then head plus the entries is the tree the patch makes.
func checkEarly(st *prepState, head string, ea *earlyPatch, res *prepared) error {
	if len(res.lfs) > 0 {
		return errors.New("files tracked by Git LFS changed")
	}
	sent := make(map[string]helperproto.PushEntry, len(ea.entries))
	for _, e := range ea.entries {
		sent[e.Path] = e
	}
	type entry struct {
		mode uint32
		oid  string
	}
	staged := map[string]entry{}
	if _, err := walkIndex(st.small, len(head)/2, func(name string, mode uint32, oid []byte) {
		if _, ok := sent[name]; ok {
			staged[name] = entry{mode, hex.EncodeToString(oid)}
		}
	}); err != nil {
		return fmt.Errorf("read the sync index: %w", err)
	}
	for _, e := range ea.entries {
		got, ok := staged[e.Path]
		var err error
		switch {
		case e.Mode == 0 && ok:
			err = fmt.Errorf("%s was sent as removed, git staged it", e.Path)
		case e.Mode != 0 && !ok:
			err = fmt.Errorf("%s was sent, git did not stage it", e.Path)
		case e.Mode != 0 && (got.mode != e.Mode || got.oid != e.OID):
			err = fmt.Errorf("%s was sent as %o %s, git staged %o %s", e.Path, e.Mode, e.OID, got.mode, got.oid)
		}
		if err != nil {
			if sp, ok := ea.stamps[e.Path]; ok && stampOf(sp.path) != sp {
				return fmt.Errorf("%w: %v", errRace, err)
			}
			return err
		}
	}
	var missing []string
	for _, rec := range res.recs {
		for _, p := range []string{rec.src, rec.dst} {
			if _, ok := sent[p]; !ok {
				missing = append(missing, p)
			}
		}
	}
	if len(missing) > 0 {
		sort.Strings(missing)
		return fmt.Errorf("git's diff names %v, which no entry names", missing)
	}
	return nil
}

package sandboxhelper

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"syscall"

	"github.com/sandboxd/sandboxd/internal/gitobj"
)

// The native sync: the server moves the working tree to the pushed tree and
// finds the command's edits itself, in time proportional to what changed.
// It knows the tree the working tree held when its tracker was last asked
// (base); every path not among the tracker's answers since then still holds
// what base says. Trees and commits are built in-process (internal/gitobj)
// instead of through an index, which git reads and writes whole (a cost
// that grows with the tree). Whenever it cannot vouch for the result
// (no base yet, the tracker unsure, rules files changed, attributes or
// settings that make files differ from their blobs) it declines before
// touching anything and the scripts take the plain way; a failure after it
// began forgets base, so the plain way's full scan repairs the tree.

// errDecline says the native sync does not apply: the caller takes the
// plain way. Nothing was changed.
var errDecline = errors.New("the native sync does not apply")

func decline(format string, a ...any) error {
	return fmt.Errorf("%w: %s", errDecline, fmt.Sprintf(format, a...))
}

// errForGood marks a decline that holds until head changes: a setting of
// the repository, attributes or a submodule in head's tree.
var errForGood = errors.New("for good")

func declineForGood(format string, a ...any) error {
	return fmt.Errorf("%w (%w): %s", errDecline, errForGood, fmt.Sprintf(format, a...))
}

// pushRequest asks the server for a native push.
type pushRequest struct {
	Head    string      `json:"head"`
	Entries []PushEntry `json:"entries"`
	// Time of the snapshot commit (Unix seconds), and the refs to update.
	Time    int64  `json:"time"`
	SnapRef string `json:"snap_ref"`
	BaseRef string `json:"base_ref"`
}

// pullRequest asks for the command's edits since the push of Tree, as a
// patch written to Out with git diff-tree's DiffArgs.
type pullRequest struct {
	Tree     string   `json:"tree"`
	Out      string   `json:"out"`
	DiffArgs []string `json:"diff_args"`
}

// nativeState is the server's knowledge for the native sync.
type nativeState struct {
	root, gitDir, state string
	changes             func(ctx context.Context) (paths, gone []string, full bool)
	store               *gitobj.Store
	// base is valid when known: the tree the working tree held at the
	// tracker's last answer.
	base  gitobj.OID
	valid bool
	// settingsChecked/settingsErr: the repository's settings, read once.
	settingsChecked bool
	settingsErr     error
	// head, headTree and attrErr: the last head pushed onto, its tree, and
	// whether its attributes decline (checkHead).
	head     gitobj.OID
	headTree gitobj.OID
	attrErr  error
}

func (n *nativeState) close() {
	if n.store != nil {
		_ = n.store.Close()
	}
}

// forget drops base: the next native push declines, the plain way scans
// the whole tree, and its adopt gives base back.
func (n *nativeState) forget() { n.valid = false }

// adopt records that the working tree holds tree (a plain push just moved
// it there); the tracker's answers since its last question cover the rest.
func (n *nativeState) adopt(tree string) error {
	oid, err := gitobj.ParseOID(tree)
	if err != nil {
		return fmt.Errorf("adopt: %w", err)
	}
	n.base, n.valid = oid, true
	return nil
}

func (n *nativeState) openStore() (*gitobj.Store, error) {
	if n.store == nil {
		s, err := gitobj.OpenStore(n.gitDir)
		if err != nil {
			return nil, decline("open the object store: %v", err)
		}
		n.store = s
	}
	return n.store, nil
}

// checkSettings declines where git would write a file other than its blob
// or read one differently: conversions, filters, no symlinks or modes, a
// case-folding or sparse checkout, another hash, submodules, global
// attributes. Read once per server: a sandbox's settings do not change
// under a sync.
func (n *nativeState) checkSettings(ctx context.Context) error {
	if n.settingsChecked {
		return n.settingsErr
	}
	n.settingsChecked = true
	n.settingsErr = func() error {
		out, err := runGit(ctx, n.root, nil, nil, "config", "-z", "--list")
		if err != nil {
			return decline("read git's settings: %v", err)
		}
		for _, kv := range bytes.Split(out, []byte{0}) {
			k, v, _ := strings.Cut(string(kv), "\n")
			k, v = strings.ToLower(k), strings.ToLower(strings.TrimSpace(v))
			switch {
			case strings.HasPrefix(k, "filter."), k == "core.attributesfile",
				k == "core.autocrlf" && v != "false", k == "core.eol" && v != "lf" && v != "native",
				k == "core.symlinks" && v == "false", k == "core.filemode" && v == "false",
				k == "core.ignorecase" && v == "true", k == "core.precomposeunicode" && v == "true",
				k == "core.sparsecheckout" && v == "true", k == "extensions.objectformat" && v != "sha1",
				k == "core.worktree", k == "core.bare" && v == "true":
				return declineForGood("git setting %s", k)
			}
		}
		for _, f := range []string{filepath.Join(n.gitDir, "info", "attributes"), filepath.Join(n.root, ".gitmodules")} {
			if _, err := os.Lstat(f); err == nil {
				return declineForGood("%s exists", f)
			}
		}
		if home, err := os.UserHomeDir(); err == nil {
			if _, err := os.Lstat(filepath.Join(home, ".config", "git", "attributes")); err == nil {
				return declineForGood("a global attributes file exists")
			}
		}
		return nil
	}()
	return n.settingsErr
}

// checkHead returns head's tree, and declines when it holds a submodule or
// an attributes file whose rules may convert files; both are kept for head
// (a push onto the same head reads nothing).
func (n *nativeState) checkHead(ctx context.Context, s *gitobj.Store, head gitobj.OID) (gitobj.OID, error) {
	if !n.head.IsZero() && n.head == head {
		return n.headTree, n.attrErr
	}
	tree, err := commitTree(ctx, s, head)
	if err != nil {
		return tree, err
	}
	var walk func(t gitobj.OID, dir string) error
	walk = func(t gitobj.OID, dir string) error {
		es, err := s.ReadTree(ctx, t)
		if err != nil {
			return err
		}
		for _, e := range es {
			switch {
			case e.Name == ".gitattributes":
				if e.Mode != gitobj.ModeFile && e.Mode != gitobj.ModeExec {
					return declineForGood("%s is not a file", path.Join(dir, e.Name))
				}
				kind, data, err := s.Read(ctx, e.OID)
				if err != nil {
					return err
				}
				if kind != "blob" {
					return declineForGood("%s is a %s", path.Join(dir, e.Name), kind)
				}
				if a := ConvertingAttribute(data); a != "" {
					return declineForGood("%s sets %s", path.Join(dir, e.Name), a)
				}
			case e.Mode == gitobj.ModeGitlink:
				return declineForGood("a submodule at %s", path.Join(dir, e.Name))
			case e.Mode == gitobj.ModeTree:
				if err := walk(e.OID, path.Join(dir, e.Name)); err != nil {
					return err
				}
			}
		}
		return nil
	}
	err = walk(tree, "")
	if err != nil && !errors.Is(err, errDecline) {
		return tree, decline("read head's tree: %v", err) // not kept: it may read next time
	}
	n.head, n.headTree, n.attrErr = head, tree, err
	return tree, err
}

// rulesFile says a path's name makes other paths' meaning: the plain way,
// which rereads them, handles changes to those.
func rulesFile(p string) bool {
	switch path.Base(p) {
	case ".gitignore", ".gitattributes", ".gitmodules":
		return true
	}
	return false
}

// beyondSymlink says a directory on the way to p is a symbolic link: git
// writes nothing through one (it could lead out of the checkout).
func (n *nativeState) beyondSymlink(p string) bool {
	for i := strings.IndexByte(p, '/'); i >= 0; i = next(p, i) {
		fi, err := os.Lstat(filepath.Join(n.root, filepath.FromSlash(p[:i])))
		if err != nil {
			return false // nothing there yet: the write makes directories
		}
		if fi.Mode()&fs.ModeSymlink != 0 {
			return true
		}
	}
	return false
}

// next is the index of the "/" after position i of p, -1 when none.
func next(p string, i int) int {
	j := strings.IndexByte(p[i+1:], '/')
	if j < 0 {
		return -1
	}
	return i + 1 + j
}

// have is what the working tree holds at a path: a file's entry, a
// directory, or nothing (also for what git does not track: sockets and
// the like).
type have struct {
	entry gitobj.Entry // Mode 0: no file
	dir   bool
}

// look reads what the working tree holds at p. With hash, a file's blob id
// is computed as git would (the settings are checked: no conversion),
// reading the file as a stream; without, only its mode is known.
func (n *nativeState) look(p string, hash bool) (have, error) {
	abs := filepath.Join(n.root, filepath.FromSlash(p))
	fi, err := os.Lstat(abs)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return have{}, nil
	}
	if err != nil {
		return have{}, err
	}
	if fi.IsDir() {
		return have{dir: true}, nil
	}
	var h have
	var ok bool
	if h.entry.Mode, ok = gitobj.ModeOf(fi); !ok || !hash {
		return h, nil
	}
	if h.entry.Mode == gitobj.ModeSymlink {
		target, err := os.Readlink(abs)
		if err != nil {
			return have{}, err
		}
		h.entry.OID = gitobj.HashObject("blob", []byte(target))
	} else if h.entry.OID, err = gitobj.HashFile(abs, fi.Size()); err != nil {
		return have{}, err
	}
	return h, nil
}

// touched gathers the tracker's answer: the file paths it names, and under
// the directories it names as gone, every file base held there. It
// declines when the tracker cannot tell, or a rules file changed.
func (n *nativeState) touched(ctx context.Context, s *gitobj.Store) (map[string]bool, error) {
	paths, gone, full := n.changes(ctx)
	n.forget() // the answer moved the tracker's "since"; base is good again only once this sync is done
	// The plain stage's index is no longer up to date with the tracker's
	// answers: its next stage looks at everything.
	_ = os.Remove(filepath.Join(n.state, "index.fast"))
	_ = os.Remove(filepath.Join(n.state, "index.tree"))
	if full {
		return nil, decline("the tracker cannot tell what changed")
	}
	set := make(map[string]bool, len(paths))
	for _, p := range paths {
		if !ValidPath(p) {
			return nil, decline("the tracker named %q", p)
		}
		if rulesFile(p) {
			return nil, decline("%s changed", p)
		}
		set[p] = true
	}
	for _, g := range gone {
		if !ValidPath(g) {
			return nil, decline("the tracker named %q", g)
		}
		set[g] = true
		files, err := filesUnder(ctx, s, n.base, g)
		if err != nil {
			return nil, err
		}
		for _, f := range files {
			if rulesFile(f) {
				return nil, decline("%s went away", f)
			}
			set[f] = true
		}
	}
	return set, nil
}

// filesUnder lists the files tree holds under dir (none when dir is not a
// directory there).
func filesUnder(ctx context.Context, s *gitobj.Store, tree gitobj.OID, dir string) ([]string, error) {
	e, ok, err := s.Lookup(ctx, tree, dir)
	if err != nil || !ok || e.Mode != gitobj.ModeTree {
		return nil, err
	}
	diffs, err := s.DiffTrees(ctx, gitobj.OID{}, e.OID)
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(diffs))
	for _, d := range diffs {
		out = append(out, dir+"/"+d.Path)
	}
	return out, nil
}

// entryAt is the file entry tree holds at p (Mode 0 when none; a directory
// there is reported by dir).
func entryAt(ctx context.Context, s *gitobj.Store, tree gitobj.OID, p string) (e gitobj.Entry, dir bool, err error) {
	e, ok, err := s.Lookup(ctx, tree, p)
	if err != nil || !ok {
		return gitobj.Entry{}, false, err
	}
	if e.Mode == gitobj.ModeTree {
		return gitobj.Entry{}, true, nil
	}
	return e, false, nil
}

// ignored returns which of paths git ignores, by the rules files of the
// working tree (no index read).
func (n *nativeState) ignored(ctx context.Context, paths []string) (map[string]bool, error) {
	out := map[string]bool{}
	if len(paths) == 0 {
		return out, nil
	}
	in := strings.Join(paths, "\x00") + "\x00"
	res, err := runGit(ctx, n.root, nil, strings.NewReader(in), "check-ignore", "--no-index", "-z", "--stdin")
	if err != nil {
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 { // 1: none ignored
			return nil, decline("git check-ignore: %v", err)
		}
	}
	for _, p := range bytes.Split(res, []byte{0}) {
		if len(p) > 0 {
			out[string(p)] = true
		}
	}
	return out, nil
}

// push moves the working tree to head plus the request's entries, records
// the snapshot commit and the refs, and returns the snapshot and its tree.
func (n *nativeState) push(ctx context.Context, req pushRequest) (snap, tree string, err error) {
	if err := n.checkSettings(ctx); err != nil {
		return "", "", err
	}
	head, err := gitobj.ParseOID(req.Head)
	if err != nil {
		return "", "", decline("head %q: %v", req.Head, err)
	}
	for _, e := range req.Entries {
		if !ValidPath(e.Path) {
			return "", "", decline("the path %q", e.Path)
		}
		// Rules files that differ from head are fine as long as they are
		// the same as at the last sync (the comparison below) and convert
		// nothing.
		switch path.Base(e.Path) {
		case ".gitmodules":
			return "", "", decline("%s differs from head", e.Path)
		case ".gitattributes":
			if e.Mode != 0 && (e.Mode == gitobj.ModeSymlink || ConvertingAttribute(e.Data) != "") {
				return "", "", decline("%s sets attributes that convert files", e.Path)
			}
		}
		switch e.Mode {
		case 0, gitobj.ModeFile, gitobj.ModeExec, gitobj.ModeSymlink:
		default:
			return "", "", decline("mode %o at %s", e.Mode, e.Path)
		}
	}
	s, err := n.openStore()
	if err != nil {
		return "", "", err
	}
	headTree, err := n.checkHead(ctx, s, head)
	if err != nil {
		return "", "", err
	}
	// Declines that hold for good come first: they spare the adopt.
	if !n.valid {
		return "", "", decline("no known base")
	}
	base := n.base
	set, err := n.touched(ctx, s)
	if err != nil {
		return "", "", err
	}
	// From here on base is forgotten until the move is done: a failure
	// leaves the plain way's full scan to repair what was half done.

	// The pushed tree: head's, with the entries; the blobs the daemon sent
	// are checked against their ids and stored.
	blobs := map[gitobj.OID][]byte{}
	changes := make([]gitobj.Change, 0, len(req.Entries))
	for _, e := range req.Entries {
		c := gitobj.Change{Path: e.Path, Mode: e.Mode}
		if e.Mode != 0 {
			if c.OID, err = gitobj.ParseOID(e.OID); err != nil {
				return "", "", decline("the blob of %s: %v", e.Path, err)
			}
			if e.Data != nil {
				if gitobj.HashObject("blob", e.Data) != c.OID {
					return "", "", decline("the content sent for %s is not its blob", e.Path)
				}
				if _, err := s.Write("blob", e.Data); err != nil {
					return "", "", fmt.Errorf("store the blob of %s: %w", e.Path, err)
				}
				blobs[c.OID] = e.Data
			}
		}
		changes = append(changes, c)
	}
	target, err := s.EditTree(ctx, headTree, changes)
	if err != nil {
		return "", "", fmt.Errorf("build the pushed tree: %w", err)
	}
	diffs, err := s.DiffTrees(ctx, base, target)
	if err != nil {
		return "", "", fmt.Errorf("compare the pushed tree: %w", err)
	}
	for _, d := range diffs {
		if rulesFile(d.Path) {
			return "", "", decline("%s differs from the last sync", d.Path)
		}
		set[d.Path] = true
	}
	plan, err := n.plan(ctx, s, base, target, set)
	if err != nil {
		return "", "", err
	}
	if err := n.apply(ctx, s, plan, blobs); err != nil {
		return "", "", err
	}
	snapID, err := n.record(ctx, s, req, target)
	if err != nil {
		return "", "", err
	}
	n.base, n.valid = target, true
	return snapID.String(), target.String(), nil
}

// step is one path of a move: write want there, or remove what is there.
type step struct {
	path string
	want gitobj.Entry // Mode 0: remove
}

// plan decides what the move does at each path of set, before anything
// is touched: the path is made to hold what target holds, except that an
// untracked file git ignores is left where target has nothing. A directory
// in the way of a file, or a file in the way of a directory, declines.
func (n *nativeState) plan(ctx context.Context, s *gitobj.Store, base, target gitobj.OID, set map[string]bool) ([]step, error) {
	paths := make([]string, 0, len(set))
	for p := range set {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	var steps []step
	var untracked []string
	for _, p := range paths {
		want, wantDir, err := entryAt(ctx, s, target, p)
		if err != nil {
			return nil, err
		}
		if n.beyondSymlink(p) {
			return nil, decline("%s is beyond a symbolic link", p)
		}
		// Only a file to compare with is hashed.
		h, err := n.look(p, want.Mode != 0)
		if err != nil {
			return nil, decline("look at %s: %v", p, err)
		}
		switch {
		case wantDir:
			if h.entry.Mode != 0 {
				return nil, decline("a file is where %s is a directory", p)
			}
			continue
		case h.dir:
			if want.Mode != 0 {
				return nil, decline("a directory is where %s is a file", p)
			}
			continue
		case h.entry == want:
			continue
		case want.Mode == 0:
			was, _, err := entryAt(ctx, s, base, p)
			if err != nil {
				return nil, err
			}
			if was.Mode == 0 {
				untracked = append(untracked, p)
				continue
			}
		}
		steps = append(steps, step{path: p, want: want})
	}
	ign, err := n.ignored(ctx, untracked)
	if err != nil {
		return nil, err
	}
	for _, p := range untracked {
		if !ign[p] {
			steps = append(steps, step{path: p})
		}
	}
	return steps, nil
}

// apply carries out a plan: files written through a temporary file and a
// rename, so a path never holds half a file; removals take the
// directories they leave empty with them, as git does.
func (n *nativeState) apply(ctx context.Context, s *gitobj.Store, plan []step, blobs map[gitobj.OID][]byte) error {
	tmpDir := filepath.Join(n.state, "tmp")
	_ = os.MkdirAll(tmpDir, 0o755)
	for _, st := range plan {
		abs := filepath.Join(n.root, filepath.FromSlash(st.path))
		if st.want.Mode == 0 {
			if err := os.Remove(abs); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return fmt.Errorf("remove %s: %w", st.path, err)
			}
			removeEmptyParents(n.root, filepath.Dir(abs))
			continue
		}
		data, ok := blobs[st.want.OID]
		if !ok {
			kind, d, err := s.Read(ctx, st.want.OID)
			if err != nil {
				return fmt.Errorf("read the blob of %s: %w", st.path, err)
			}
			if kind != "blob" {
				return fmt.Errorf("the object of %s is a %s", st.path, kind)
			}
			data = d
		}
		if err := writeEntry(abs, tmpDir, st.want.Mode, data); err != nil {
			return fmt.Errorf("write %s: %w", st.path, err)
		}
	}
	return nil
}

func writeEntry(abs, tmpDir string, mode uint32, data []byte) error {
	dir := filepath.Dir(abs)
	if err := os.MkdirAll(dir, 0o777); err != nil {
		return err
	}
	// The temporary file sits under .git (no tracker sees it, and a crash
	// leaves nothing in the working tree), or beside the file when .git is
	// on another file system.
	err := writeVia(filepath.Join(tmpDir, "w-"+newInstance()), abs, mode, data)
	if errors.Is(err, syscall.EXDEV) || errors.Is(err, fs.ErrNotExist) {
		err = writeVia(filepath.Join(dir, ".nook-"+newInstance()+".tmp"), abs, mode, data)
	}
	return err
}

// writeVia writes the entry to tmp, then renames it to abs.
func writeVia(tmp, abs string, mode uint32, data []byte) error {
	if mode == gitobj.ModeSymlink {
		if err := os.Symlink(string(data), tmp); err != nil {
			return err
		}
	} else {
		perm := os.FileMode(0o666)
		if mode == gitobj.ModeExec {
			perm = 0o777
		}
		f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
		if err != nil {
			return err
		}
		_, werr := f.Write(data)
		cerr := f.Close()
		if werr != nil || cerr != nil {
			_ = os.Remove(tmp)
			return errors.Join(werr, cerr)
		}
	}
	if err := os.Rename(tmp, abs); err != nil {
		_ = os.Remove(tmp)
		return err
	}
	return nil
}

// removeEmptyParents removes dir and its parents up to root while empty.
func removeEmptyParents(root, dir string) {
	for dir != root && strings.HasPrefix(dir, root+string(filepath.Separator)) {
		if os.Remove(dir) != nil {
			return
		}
		dir = filepath.Dir(dir)
	}
}

// record writes the snapshot commit (target on head) and moves HEAD and
// the sync refs in one git process; the user's index is reset to head
// when it is not as the helper left it for head, and what a reset clears
// (a merge left half done) goes.
func (n *nativeState) record(ctx context.Context, s *gitobj.Store, req pushRequest, target gitobj.OID) (gitobj.OID, error) {
	date := fmt.Sprintf("%d +0000", req.Time)
	commit := fmt.Sprintf("tree %s\nparent %s\nauthor sandboxd <sandboxd@localhost> %s\ncommitter sandboxd <sandboxd@localhost> %s\n\nsandboxd sync\n",
		target, req.Head, date, date)
	snap, err := s.Write("commit", []byte(commit))
	if err != nil {
		return snap, fmt.Errorf("write the snapshot commit: %w", err)
	}
	if !strings.HasPrefix(req.SnapRef, "refs/") || !strings.HasPrefix(req.BaseRef, "refs/") || !ValidPath(req.SnapRef) || !ValidPath(req.BaseRef) {
		return snap, fmt.Errorf("the refs %q and %q are not full ref names", req.SnapRef, req.BaseRef)
	}
	if readsAs(n.gitDir, "HEAD", req.Head) && readsAs(n.gitDir, req.BaseRef, req.Head) {
		if err := writeLooseRef(n.gitDir, req.SnapRef, snap.String()); err != nil {
			return snap, fmt.Errorf("update the snapshot's ref: %w", err)
		}
	} else {
		refs := fmt.Sprintf("update HEAD %s\nupdate %s %s\nupdate %s %s\n", req.Head, req.SnapRef, snap, req.BaseRef, req.Head)
		// A reflog entry names a committer: without one git looks up the
		// user and the host name (a DNS query).
		ident := []string{"GIT_COMMITTER_NAME=sandboxd", "GIT_COMMITTER_EMAIL=sandboxd@localhost"}
		if _, err := runGit(ctx, n.root, ident, strings.NewReader(refs), "update-ref", "--stdin"); err != nil {
			return snap, fmt.Errorf("update the refs: %w", err)
		}
	}
	if err := resetReal(ctx, StageOptions{Root: n.root, State: n.state, Head: req.Head, Real: filepath.Join(n.gitDir, "index")}); err != nil {
		return snap, err
	}
	for _, x := range []string{"MERGE_HEAD", "MERGE_MSG", "MERGE_MODE", "MERGE_RR", "SQUASH_MSG", "CHERRY_PICK_HEAD", "REVERT_HEAD", "AUTO_MERGE"} {
		_ = os.Remove(filepath.Join(n.gitDir, x))
	}
	return snap, nil
}

// pull finds the command's edits since the push of req.Tree and writes
// them to req.Out as a patch (empty when nothing changed).
func (n *nativeState) pull(ctx context.Context, req pullRequest) error {
	if !n.valid || n.base.String() != req.Tree {
		return decline("the base is not the pushed tree")
	}
	if err := n.checkSettings(ctx); err != nil {
		return err
	}
	s, err := n.openStore()
	if err != nil {
		return err
	}
	base := n.base
	set, err := n.touched(ctx, s)
	if err != nil {
		return err
	}
	paths := make([]string, 0, len(set))
	for p := range set {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	var changes []gitobj.Change
	var added []string
	for _, p := range paths {
		was, wasDir, err := entryAt(ctx, s, base, p)
		if err != nil {
			return err
		}
		var h have
		if !n.beyondSymlink(p) { // else git sees no file there
			// A new file is hashed only if git does not ignore it.
			if h, err = n.look(p, was.Mode != 0); err != nil {
				return decline("look at %s: %v", p, err)
			}
		}
		switch {
		case h.dir || (wasDir && h.entry.Mode == 0):
			continue // the files under it are named on their own
		case h.entry == was:
			continue
		case was.Mode == 0:
			added = append(added, p)
			continue
		}
		c, err := n.change(s, p, h)
		if err != nil {
			return err
		}
		changes = append(changes, c)
	}
	ign, err := n.ignored(ctx, added)
	if err != nil {
		return err
	}
	for _, p := range added {
		if ign[p] {
			continue
		}
		h, err := n.look(p, true)
		if err != nil {
			return decline("look at %s: %v", p, err)
		}
		if h.entry.Mode == 0 {
			continue // gone since
		}
		c, err := n.change(s, p, h)
		if err != nil {
			return err
		}
		changes = append(changes, c)
	}
	next, err := s.EditTree(ctx, base, changes)
	if err != nil {
		return fmt.Errorf("build the edited tree: %w", err)
	}
	var patch []byte
	if next != base {
		args := append(append([]string{"diff-tree", "-p"}, req.DiffArgs...), base.String(), next.String(), "--")
		if patch, err = runGit(ctx, n.root, nil, nil, args...); err != nil {
			return fmt.Errorf("diff the edits: %w", err)
		}
	}
	if err := os.WriteFile(req.Out, patch, 0o644); err != nil {
		return fmt.Errorf("write the patch: %w", err)
	}
	// The tree this pull left: the next push asks again against it, so
	// that edits made outside an exec are found without git.
	if err := os.WriteFile(filepath.Join(n.state, "pulled.tree"), []byte(next.String()+"\n"), 0o644); err != nil {
		return fmt.Errorf("record the pulled tree: %w", err)
	}
	n.base, n.valid = next, true
	return nil
}

// change is the tree change making p what h says, its blob stored.
func (n *nativeState) change(s *gitobj.Store, p string, h have) (gitobj.Change, error) {
	c := gitobj.Change{Path: p, Mode: h.entry.Mode, OID: h.entry.OID}
	if h.entry.Mode != 0 {
		if err := n.storeBlob(s, p, h.entry); err != nil {
			return c, err
		}
	}
	return c, nil
}

// storeBlob stores the blob of the file at p, read again: it must still be
// what look hashed (the command may still write it from the background).
func (n *nativeState) storeBlob(s *gitobj.Store, p string, e gitobj.Entry) error {
	abs := filepath.Join(n.root, filepath.FromSlash(p))
	var data []byte
	var err error
	if e.Mode == gitobj.ModeSymlink {
		var t string
		t, err = os.Readlink(abs)
		data = []byte(t)
	} else {
		data, err = os.ReadFile(abs)
	}
	if err != nil {
		return decline("read %s: %v", p, err)
	}
	if gitobj.HashObject("blob", data) != e.OID {
		return decline("%s changed while it was read", p)
	}
	if _, err := s.Write("blob", data); err != nil {
		return fmt.Errorf("store the blob of %s: %w", p, err)
	}
	return nil
}

// readsAs says ref holds id.
func readsAs(gitDir, ref, id string) bool {
	got, ok := gitobj.ReadRef(gitDir, ref)
	return ok && got == id
}

// commitTree is the tree of commit c.
func commitTree(ctx context.Context, s *gitobj.Store, c gitobj.OID) (gitobj.OID, error) {
	kind, data, err := s.Read(ctx, c)
	if err != nil {
		return gitobj.OID{}, decline("read commit %s: %v", c, err)
	}
	if kind != "commit" || !bytes.HasPrefix(data, []byte("tree ")) || len(data) < 45 {
		return gitobj.OID{}, decline("%s is not a commit", c)
	}
	return gitobj.ParseOID(string(data[5:45]))
}

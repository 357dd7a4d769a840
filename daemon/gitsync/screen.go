package gitsync

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Refused is an entry of a pulled patch that was not applied: content
// that the user's tools would execute or misread, or a path the daemon
// owns. The saved patch keeps it.
type Refused struct {
	Path   string `json:"path"`
	Reason string `json:"reason"`
}

// Reasons an entry is refused.
const (
	reasonControl   = "its name has control characters or is not UTF-8"
	reasonGitPath   = "it is a .git path"
	reasonDaemon    = "it is a file sandboxd owns (.rwx/sandboxes/)"
	reasonSubmodule = "it is a submodule entry"
	reasonLinkOut   = "it is a symlink that points outside the checkout"
	reasonLinkGit   = "it is a symlink that points into a .git directory"
	reasonLinkThru  = "it is a symlink whose target goes through another symlink"
	reasonLinkBad   = "it is a symlink whose target has control characters"
	reasonLinkHid   = "it is a symlink whose target the patch does not show"
	reasonGitDir    = "it would make %s look like a git directory (HEAD with objects/ and refs/, or commondir), whose config git runs"
)

// daemonOwned are the checkout paths the daemon reads as its own state:
// a pull never writes them.
var daemonOwned = []string{".rwx/sandboxes"}

// pulledEntry is one file of a patch from the sandbox, as git apply takes
// it: its names (old is empty for a new file, new for a deleted one), its
// new mode, and for a symlink its target.
type pulledEntry struct {
	old, new string
	mode     string
	deleted  bool
	rename   bool
	binary   bool
	// target is a symlink's target; known says the patch shows it whole.
	target string
	known  bool
}

// path is the name git apply's --exclude matches: the new one, else the
// old one.
func (e pulledEntry) path() string {
	if e.new != "" {
		return e.new
	}
	return e.old
}

// screenPulled lists the entries of a patch from the sandbox that must not
// be applied, and why. The names are git's own (`git apply --numstat`);
// the modes and symlink targets, which that does not show, come from
// reading the patch, and a patch whose entries do not match git's is
// refused whole (err).
func (s *Syncer) screenPulled(ctx context.Context, rp repo, patch []byte) (entries []pulledEntry, refused []Refused, err error) {
	out, err := s.run(ctx, gitCall{dir: rp.root, stdin: bytes.NewReader(patch)}, "apply", "--numstat", "-z", "-")
	if err != nil {
		return nil, nil, fmt.Errorf("read the sandbox's patch: %w", err)
	}
	entries, err = parsePulled(patch)
	if err != nil {
		return nil, nil, err
	}
	if err := matchNumstat(entries, splitZ(out)); err != nil {
		return nil, nil, err
	}
	return entries, screenEntries(rp.root, entries), nil
}

// screenEntries checks each entry on its own, then the directories the
// pull makes look like git directories.
func screenEntries(root string, entries []pulledEntry) []Refused {
	var refused []Refused
	bad := map[string]bool{}
	refuse := func(e pulledEntry, reason string) {
		if !bad[e.path()] {
			bad[e.path()] = true
			refused = append(refused, Refused{Path: e.path(), Reason: reason})
		}
	}
	for _, e := range entries {
		if r := screenEntry(root, e); r != "" {
			refuse(e, r)
		}
	}
	for _, d := range gitLikeDirs(root, entries) {
		for _, e := range entries {
			if !e.deleted && strings.HasPrefix(strings.ToLower(e.new), strings.ToLower(d)+"/") {
				refuse(e, fmt.Sprintf(reasonGitDir, d))
			}
		}
	}
	return refused
}

func screenEntry(root string, e pulledEntry) string {
	for _, name := range []string{e.old, e.new} {
		if name == "" {
			continue
		}
		if !cleanName(name) {
			return reasonControl
		}
		for _, c := range strings.Split(name, "/") {
			if gitComponent(c) {
				return reasonGitPath
			}
		}
		// Lower case: on a case-insensitive file system .RWX/Sandboxes is
		// the same directory.
		lower := strings.ToLower(name)
		for _, d := range daemonOwned {
			if lower == d || strings.HasPrefix(lower, d+"/") {
				return reasonDaemon
			}
		}
	}
	if e.deleted {
		return ""
	}
	switch e.mode {
	case "160000":
		return reasonSubmodule
	case "120000":
		return screenLink(root, e)
	}
	return ""
}

// screenLink refuses a symlink unless its target, read as a path from the
// link's directory, stays in the checkout, out of .git, and goes through
// no symlink the checkout has.
func screenLink(root string, e pulledEntry) string {
	if !e.known {
		return reasonLinkHid
	}
	t := e.target
	if t == "" || !cleanName(t) {
		return reasonLinkBad
	}
	if path.IsAbs(t) {
		return reasonLinkOut
	}
	dest := path.Join(path.Dir(e.new), t)
	if dest == ".." || strings.HasPrefix(dest, "../") {
		return reasonLinkOut
	}
	parts := strings.Split(dest, "/")
	for _, c := range parts {
		if gitComponent(c) {
			return reasonLinkGit
		}
	}
	for i := range parts {
		if dest == "." {
			break
		}
		fi, err := os.Lstat(filepath.Join(root, filepath.FromSlash(strings.Join(parts[:i+1], "/"))))
		if err != nil {
			break
		}
		if fi.Mode()&os.ModeSymlink != 0 {
			return reasonLinkThru
		}
	}
	return ""
}

// gitLikeDirs are the directories that, after the pull, hold what makes
// git take a directory for a repository (setup.c is_git_directory: HEAD,
// and objects/ with refs/ or a commondir file), counting the pulled files
// and those the checkout has; only directories the pull writes in.
func gitLikeDirs(root string, entries []pulledEntry) []string {
	pulled := map[string]bool{}
	cands := map[string]bool{}
	for _, e := range entries {
		if e.deleted || e.new == "" {
			continue
		}
		parts := strings.Split(e.new, "/")
		for i := 1; i < len(parts); i++ {
			pulled[strings.ToLower(strings.Join(parts[:i], "/"))] = true
			cands[strings.Join(parts[:i], "/")] = true
		}
		pulled[strings.ToLower(e.new)] = true
	}
	// Without case, as a case-insensitive file system finds them.
	has := func(p string) bool {
		if pulled[strings.ToLower(p)] {
			return true
		}
		_, err := os.Lstat(filepath.Join(root, filepath.FromSlash(p)))
		return err == nil
	}
	var dirs []string
	for d := range cands {
		if has(d+"/HEAD") && (has(d+"/commondir") || has(d+"/objects") && has(d+"/refs")) {
			dirs = append(dirs, d)
		}
	}
	return dirs
}

// gitComponent says a path component names a git directory on some file
// system (case-insensitive ones, and NTFS's short name).
func gitComponent(c string) bool {
	c = strings.TrimRight(c, ". ")
	return strings.EqualFold(c, ".git") || strings.EqualFold(c, "git~1")
}

// cleanName accepts valid UTF-8 without control characters (C0, DEL, C1):
// a name that ls or a terminal shows as what it is.
func cleanName(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if unicode.IsControl(r) {
			return false
		}
	}
	return true
}

// matchNumstat checks that the entries read from the patch are git's, in
// git's order: `git apply --numstat -z` records "a\td\tpath" or, for a
// rename or copy, "a\td\t", old, new.
func matchNumstat(entries []pulledEntry, f []string) error {
	i := 0
	for k, e := range entries {
		if i >= len(f) {
			return fmt.Errorf("the sandbox's patch has %d entries as git reads it, fewer than it shows (%d)", k, len(entries))
		}
		parts := strings.SplitN(f[i], "\t", 3)
		if len(parts) != 3 {
			return fmt.Errorf("unexpected answer from git apply --numstat: %q", clip([]byte(f[i])))
		}
		var ok bool
		if parts[2] == "" {
			ok = i+2 < len(f) && e.rename && f[i+1] == e.old && f[i+2] == e.new
			i += 3
		} else {
			ok = parts[2] == e.path()
			i++
		}
		if !ok {
			return fmt.Errorf("the sandbox's patch does not read the same to git and to sandboxd at entry %d (%q)", k+1, clip([]byte(e.path())))
		}
	}
	if i != len(f) {
		return fmt.Errorf("the sandbox's patch has more entries as git reads it than it shows (%d)", len(entries))
	}
	return nil
}

// parsePulled reads the entries of a patch in git's format (diff --git
// sections): names, modes, and the whole post-image of a symlink.
func parsePulled(patch []byte) ([]pulledEntry, error) {
	var entries []pulledEntry
	var e *pulledEntry
	// Hunk state: lines left on each side; post is the symlink's
	// post-image so far; hunks counts them.
	oldLeft, newLeft, hunks := 0, 0, 0
	var post []string
	noEOL := false
	lastPost := false
	finish := func() {
		if e == nil {
			return
		}
		if e.mode == "120000" && !e.deleted && !e.binary && hunks == 1 {
			e.target, e.known = strings.Join(post, "\n"), true
			if !noEOL {
				e.target += "\n"
			}
		}
		entries = append(entries, *e)
		e = nil
	}
	lines := bytes.Split(patch, []byte("\n"))
	if len(lines) > 0 && len(lines[len(lines)-1]) == 0 {
		lines = lines[:len(lines)-1]
	}
	for _, lb := range lines {
		l := string(lb)
		if oldLeft > 0 || newLeft > 0 {
			switch {
			case strings.HasPrefix(l, " "):
				oldLeft--
				newLeft--
				post = append(post, l[1:])
				lastPost = true
			case strings.HasPrefix(l, "-"):
				oldLeft--
				lastPost = false
			case strings.HasPrefix(l, "+"):
				newLeft--
				post = append(post, l[1:])
				lastPost = true
			case l == "":
				// An empty context line some tools leave without its space.
				oldLeft--
				newLeft--
				post = append(post, "")
				lastPost = true
			case strings.HasPrefix(l, `\`):
				if lastPost {
					noEOL = true
				}
			default:
				return nil, fmt.Errorf("the sandbox's patch has a damaged hunk in %q", clip([]byte(e.path())))
			}
			continue
		}
		if strings.HasPrefix(l, `\`) {
			if lastPost {
				noEOL = true
			}
			continue
		}
		if rest, ok := strings.CutPrefix(l, "diff --git "); ok {
			finish()
			e = &pulledEntry{}
			hunks, post, noEOL, lastPost = 0, nil, false, false
			a, b, ok := splitGitHeader(rest)
			if !ok {
				return nil, fmt.Errorf("the sandbox's patch has a header sandboxd cannot read: %q", clip(lb))
			}
			e.old, e.new = a, b
			continue
		}
		if e == nil {
			continue
		}
		switch {
		case strings.HasPrefix(l, "@@ "):
			o, n, start, ok := hunkHeader(l)
			if !ok {
				return nil, fmt.Errorf("the sandbox's patch has a hunk header sandboxd cannot read: %q", clip(lb))
			}
			hunks++
			if start != 1 && n > 0 {
				hunks++ // not the whole post-image
			}
			oldLeft, newLeft = o, n
			noEOL = false
		case strings.HasPrefix(l, "GIT binary patch"), strings.HasPrefix(l, "Binary files "):
			e.binary = true
		case hunks > 0 || e.binary:
			// Binary data, or what follows a hunk before the next section.
		case strings.HasPrefix(l, "new file mode "):
			e.mode, e.old = strings.TrimPrefix(l, "new file mode "), ""
		case strings.HasPrefix(l, "new mode "):
			e.mode = strings.TrimPrefix(l, "new mode ")
		case strings.HasPrefix(l, "deleted file mode "):
			e.deleted, e.new = true, ""
		case strings.HasPrefix(l, "index "):
			if f := strings.Fields(l); len(f) == 3 && e.mode == "" {
				e.mode = f[2]
			}
		case strings.HasPrefix(l, "rename from "), strings.HasPrefix(l, "copy from "):
			_, name, _ := strings.Cut(l, " from ")
			e.rename, e.old = true, unquoteName(name)
		case strings.HasPrefix(l, "rename to "), strings.HasPrefix(l, "copy to "):
			_, name, _ := strings.Cut(l, " to ")
			e.rename, e.new = true, unquoteName(name)
		case strings.HasPrefix(l, "--- "):
			if n := lineName(strings.TrimPrefix(l, "--- ")); n == "/dev/null" {
				e.old = ""
			} else if name, ok := strings.CutPrefix(n, "a/"); ok {
				e.old = name
			}
		case strings.HasPrefix(l, "+++ "):
			if n := lineName(strings.TrimPrefix(l, "+++ ")); n == "/dev/null" {
				e.new, e.deleted = "", true
			} else if name, ok := strings.CutPrefix(n, "b/"); ok {
				e.new = name
			}
		}
	}
	finish()
	return entries, nil
}

// splitGitHeader reads "a/<old> b/<new>" of a diff --git line, either name
// C-quoted; unquoted names with spaces are read as git does when both are
// the same.
func splitGitHeader(rest string) (a, b string, ok bool) {
	if strings.HasPrefix(rest, `"`) {
		end := quotedEnd(rest)
		if end < 0 || end+1 >= len(rest) || rest[end+1] != ' ' {
			return "", "", false
		}
		a = unquoteName(rest[:end+1])
		b = unquoteName(rest[end+2:])
	} else if i := strings.Index(rest, ` "`); i >= 0 {
		a, b = rest[:i], unquoteName(rest[i+1:])
	} else {
		if len(rest)%2 == 0 {
			return "", "", false
		}
		mid := len(rest) / 2
		if rest[mid] != ' ' {
			return "", "", false
		}
		a, b = rest[:mid], rest[mid+1:]
	}
	a, okA := strings.CutPrefix(a, "a/")
	b, okB := strings.CutPrefix(b, "b/")
	return a, b, okA && okB
}

// lineName is the name of a ---/+++ line: C-quoted, or up to a tab (git
// ends a name that has a space with one).
func lineName(s string) string {
	if strings.HasPrefix(s, `"`) {
		return unquoteName(s)
	}
	name, _, _ := strings.Cut(s, "\t")
	return name
}

// quotedEnd is the index of the quote that closes s's opening one.
func quotedEnd(s string) int {
	for i := 1; i < len(s); i++ {
		switch s[i] {
		case '\\':
			i++
		case '"':
			return i
		}
	}
	return -1
}

// unquoteName undoes git's C-style quoting of a name; a name git did not
// quote is as it is.
func unquoteName(s string) string {
	if !strings.HasPrefix(s, `"`) {
		return s
	}
	u, err := strconv.Unquote(s)
	if err != nil {
		// Read differently from git: matchNumstat then refuses the patch.
		return "\x00" + s
	}
	return u
}

// hunkHeader reads "@@ -a[,b] +c[,d] @@": the lines of each side and the
// new side's start.
func hunkHeader(l string) (oldLines, newLines, newStart int, ok bool) {
	f := strings.Fields(l)
	if len(f) < 4 || f[3] != "@@" || !strings.HasPrefix(f[1], "-") || !strings.HasPrefix(f[2], "+") {
		return 0, 0, 0, false
	}
	side := func(s string) (start, n int, ok bool) {
		a, b, has := strings.Cut(s, ",")
		start, err := strconv.Atoi(a)
		if err != nil || start < 0 {
			return 0, 0, false
		}
		n = 1
		if has {
			if n, err = strconv.Atoi(b); err != nil || n < 0 {
				return 0, 0, false
			}
		}
		return start, n, true
	}
	_, o, ok1 := side(f[1][1:])
	ns, n, ok2 := side(f[2][1:])
	return o, n, ns, ok1 && ok2
}

// maxSandboxText bounds what the sandbox said that goes into a message.
const maxSandboxText = 2 << 10

// sandboxText is what the sandbox said (a script's stderr), made fit for
// a message to the user's terminal: trimmed, at most maxSandboxText bytes,
// control characters but newlines and tabs shown escaped (no terminal
// escape from the sandbox reaches the terminal).
func sandboxText(s string) string {
	s = strings.TrimSpace(s)
	if len(s) > maxSandboxText {
		s = s[:maxSandboxText] + "…"
	}
	var b strings.Builder
	for _, r := range s {
		switch {
		case r == utf8.RuneError:
			b.WriteString(`\ufffd`)
		case r == '\n' || r == '\t' || !unicode.IsControl(r):
			b.WriteRune(r)
		default:
			fmt.Fprintf(&b, "\\x%02x", r)
		}
	}
	return b.String()
}

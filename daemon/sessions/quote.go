package sessions

import (
	"path/filepath"
	"sort"
	"strings"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// commandLine is the remote shell command of an exec: env as assignments
// in front of the command (the shell exports them to it alone), then argv.
// A first argument that looks like an assignment is quoted so the shell
// runs it instead of assigning it.
func commandLine(env map[string]string, argv []string) string {
	var b strings.Builder
	keys := make([]string, 0, len(env))
	for k := range env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		b.WriteString(k)
		b.WriteByte('=')
		b.WriteString(quoteArg(env[k], true))
		b.WriteByte(' ')
	}
	b.WriteString(shellQuote(argv))
	return b.String()
}

// shellQuote joins argv into one POSIX shell command line that the remote
// /bin/sh splits back into exactly these arguments: every argument that is
// not plainly safe is single-quoted, with embedded single quotes closed,
// escaped and reopened. Spaces, quotes, $, globs, newlines and any UTF-8 pass
// through unchanged.
func shellQuote(argv []string) string {
	var b strings.Builder
	for i, a := range argv {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(quoteArg(a, i == 0 && strings.Contains(a, "=")))
	}
	return b.String()
}

// quoteArg quotes one word unless it is plainly safe (always when force).
func quoteArg(a string, force bool) string {
	if !force && a != "" && strings.IndexFunc(a, unsafeShellRune) < 0 {
		return a
	}
	return "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
}

func unsafeShellRune(r rune) bool {
	switch {
	case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9':
		return false
	}
	return !strings.ContainsRune("-_./=:,+@%", r)
}

// remoteCommand is the command line an exec sends: commandLine run by a
// shell that outlives the signals of the caller's Ctrl-C. The remote shell
// that reads the line shares the command's process group, so a SIGINT that
// the command traps (exiting 7, say) would otherwise kill that shell and
// turn the status into 130. The handler (never an ignore, which the command
// would inherit) keeps the shell alive to report the command's own status;
// a command a signal killed is reported the same way, by re-raising it.
// dir, when not empty, is the directory relative to the checkout's root to
// run in; its absence is reported with exit status 125.
func remoteCommand(dir string, env map[string]string, argv []string) string {
	cd := ""
	if dir != "" {
		msg := "nook: the sandbox has no directory " + dir + " (yours, relative to the repository root): " +
			"a directory git ignores or that holds no file is not synced; run at the root with --root"
		cd = "cd -- " + quoteArg(dir, false) + " 2>/dev/null || { printf '%s\\n' " + quoteArg(msg, true) + " >&2; exit 125; }\n"
	}
	return "trap : HUP INT QUIT TERM\n" + cd + commandLine(env, argv) + "\n" +
		`s=$?; if [ "$s" -gt 128 ] && [ "$s" -lt 160 ]; then trap - HUP INT QUIT TERM; kill -$((s - 128)) $$; fi; exit "$s"`
}

// execDir is the directory an exec runs in, relative to the root of the
// sandbox's checkout: the caller's, unless it asked for the root or is not
// inside the session's repository (then ""). p.cwd is the caller's
// resolved cwd when the target was located; a run id target resolves its
// own.
func execDir(req ipc.ExecRequest, p place, s *store.Session) string {
	if req.Root {
		return ""
	}
	cwd := p.cwd
	if cwd == "" && filepath.IsAbs(req.Cwd) {
		cwd = filepath.Clean(req.Cwd)
		if real, err := filepath.EvalSymlinks(cwd); err == nil {
			cwd = real
		}
	}
	if cwd == "" || s.RepoRoot == "" {
		return ""
	}
	rel, err := filepath.Rel(s.RepoRoot, cwd)
	if err != nil || rel == "." || rel == ".." || strings.HasPrefix(rel, "../") {
		return ""
	}
	rel = filepath.ToSlash(rel)
	if first, _, _ := strings.Cut(rel, "/"); first == ".git" {
		return ""
	}
	return rel
}

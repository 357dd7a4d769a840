package sessions

import (
	"sort"
	"strings"
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
func remoteCommand(env map[string]string, argv []string) string {
	return "trap : HUP INT QUIT TERM\n" + commandLine(env, argv) + "\n" +
		`s=$?; if [ "$s" -gt 128 ] && [ "$s" -lt 160 ]; then trap - HUP INT QUIT TERM; kill -$((s - 128)) $$; fi; exit "$s"`
}

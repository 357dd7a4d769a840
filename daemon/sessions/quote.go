package sessions

import "strings"

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
		if a != "" && strings.IndexFunc(a, unsafeShellRune) < 0 {
			b.WriteString(a)
			continue
		}
		b.WriteByte('\'')
		b.WriteString(strings.ReplaceAll(a, "'", `'\''`))
		b.WriteByte('\'')
	}
	return b.String()
}

func unsafeShellRune(r rune) bool {
	switch {
	case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9':
		return false
	}
	return !strings.ContainsRune("-_./=:,+@%", r)
}

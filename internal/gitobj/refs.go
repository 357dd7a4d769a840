package gitobj

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"strings"
)

// ReadRef resolves ref (HEAD or a full name under refs/) from the files of
// a plain git directory: a detached HEAD, HEAD naming a ref, a loose ref, a
// packed ref. ok is false when git should be asked instead (no such ref, a
// linked worktree, a ref naming another ref, something that is not an
// object id): reading them costs no process where the layout is the common
// one.
func ReadRef(gitDir, ref string) (id string, ok bool) {
	if ref == "HEAD" {
		b, err := os.ReadFile(filepath.Join(gitDir, "HEAD"))
		if err != nil {
			return "", false
		}
		head := strings.TrimSpace(string(b))
		if isObjectID(head) {
			return head, true
		}
		target, sym := strings.CutPrefix(head, "ref: ")
		if !sym {
			return "", false
		}
		if _, err := os.Stat(filepath.Join(gitDir, "commondir")); err == nil {
			return "", false // a linked worktree: its refs live elsewhere
		}
		ref = target
	}
	if !strings.HasPrefix(ref, "refs/") || strings.Contains(ref, "..") {
		return "", false
	}
	if b, err := os.ReadFile(filepath.Join(gitDir, filepath.FromSlash(ref))); err == nil {
		id := strings.TrimSpace(string(b))
		return id, isObjectID(id) // else a symbolic ref to a ref
	}
	f, err := os.Open(filepath.Join(gitDir, "packed-refs"))
	if err != nil {
		return "", false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	suffix := []byte(" " + ref)
	for sc.Scan() {
		line := sc.Bytes()
		if bytes.HasSuffix(line, suffix) {
			if id := string(line[:len(line)-len(suffix)]); isObjectID(id) {
				return id, true
			}
		}
	}
	return "", false
}

// isObjectID says s is a full object id of SHA-1 or SHA-256, as git writes
// them (lowercase hex).
func isObjectID(s string) bool {
	if len(s) != 40 && len(s) != 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

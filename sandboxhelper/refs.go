package sandboxhelper

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// The refs of a native push. Usually only the snapshot moves: HEAD and the
// base already hold head. That one ref is written here, as git writes a
// loose ref (a lock file created exclusively, then renamed over the ref),
// instead of by a git process; anything else goes to git update-ref.

// resolveRef is the commit id ref (a full name, or HEAD) holds in gitDir,
// following symbolic refs; "" when it holds none or cannot be read plainly.
func resolveRef(gitDir, ref string) string {
	for range 5 {
		b, err := os.ReadFile(filepath.Join(gitDir, filepath.FromSlash(ref)))
		if errors.Is(err, os.ErrNotExist) {
			return packedRef(gitDir, ref)
		}
		if err != nil {
			return ""
		}
		s := strings.TrimSpace(string(b))
		target, sym := strings.CutPrefix(s, "ref: ")
		if !sym {
			return s
		}
		ref = target
	}
	return ""
}

// packedRef looks ref up in packed-refs.
func packedRef(gitDir, ref string) string {
	f, err := os.Open(filepath.Join(gitDir, "packed-refs"))
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	suffix := []byte(" " + ref)
	for sc.Scan() {
		line := sc.Bytes()
		if bytes.HasSuffix(line, suffix) && len(line) == 40+len(suffix) {
			return string(line[:40])
		}
	}
	return ""
}

// writeLooseRef points ref at id as git does: through ref.lock, refused
// while another writer holds the lock.
func writeLooseRef(gitDir, ref, id string) error {
	name := filepath.Join(gitDir, filepath.FromSlash(ref))
	if err := os.MkdirAll(filepath.Dir(name), 0o777); err != nil {
		return err
	}
	lock := name + ".lock"
	f, err := os.OpenFile(lock, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o666)
	if err != nil {
		return fmt.Errorf("lock %s: %w", ref, err)
	}
	_, werr := f.WriteString(id + "\n")
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr == nil {
		werr = os.Rename(lock, name)
	}
	if werr != nil {
		_ = os.Remove(lock)
		return fmt.Errorf("write %s: %w", ref, werr)
	}
	return nil
}

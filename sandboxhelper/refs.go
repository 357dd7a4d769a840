package sandboxhelper

import (
	"fmt"
	"os"
	"path/filepath"
)

// The refs of a native push. Usually only the snapshot moves: HEAD and the
// base already hold head (gitobj.ReadRef). That one ref is written here, as
// git writes a loose ref (a lock file created exclusively, then renamed
// over the ref), instead of by a git process; anything else goes to git
// update-ref.

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

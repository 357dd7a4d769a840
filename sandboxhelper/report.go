package sandboxhelper

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

// report prints the exchange's report after a native pull: the push's
// snapshot, the command's status, the pull's header and patch (written to
// o.Pull.Out by the server), the end line. It names the patch in pull.id
// first, so that a transfer that breaks can fetch it again.
func report(o RunOptions, snap string, status int, w io.Writer) error {
	id := o.Pending
	if id == "" {
		id = "none"
		if b, err := os.ReadFile(filepath.Join(o.State, "pending")); err == nil {
			if line, _, _ := strings.Cut(string(b), "\n"); line != "" {
				id = line
			}
		}
	}
	f, err := os.Open(o.Pull.Out)
	if err != nil {
		return fmt.Errorf("open the pull's patch: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("open the pull's patch: %w", err)
	}
	if err := os.WriteFile(filepath.Join(o.State, "pull.id"), []byte(id+"\n"), 0o644); err != nil {
		return fmt.Errorf("name the pull's patch: %w", err)
	}
	size, code := fi.Size(), 0
	if size > o.Report.Max {
		code = ExitPullTooLarge
	}
	head := fmt.Sprintf("%s\npush 0 %s 1\nexit %d\n%s%s %d\n", Boundary(o.Report.Nonce), snap, status, PullHeader, id, size)
	end := fmt.Sprintf("%s-end %d\n", Boundary(o.Report.Nonce), code)
	if code == 0 && size <= 64<<10 {
		// The common case in one write.
		b := make([]byte, len(head)+int(size), len(head)+int(size)+len(end))
		copy(b, head)
		if _, err := io.ReadFull(f, b[len(head):]); err != nil {
			return fmt.Errorf("read the pull's patch: %w", err)
		}
		b = append(b, end...)
		if _, err := w.Write(b); err != nil {
			return fmt.Errorf("print the report: %w", err)
		}
		return nil
	}
	if _, err := io.WriteString(w, head); err != nil {
		return fmt.Errorf("print the report: %w", err)
	}
	if code == 0 {
		if n, err := io.Copy(w, io.LimitReader(f, size)); err != nil || n != size {
			return fmt.Errorf("print the pull's patch (%d of %d bytes): %v", n, size, err)
		}
	}
	if _, err := io.WriteString(w, end); err != nil {
		return fmt.Errorf("print the report: %w", err)
	}
	return nil
}

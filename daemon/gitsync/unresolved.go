package gitsync

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// unresolvedFile records what a conflicted pull left in the working tree, so
// the next exec can warn while it is still there.
const unresolvedFile = "unresolved.json"

type unresolved struct {
	Patch     string   `json:"patch"`
	Conflicts []string `json:"conflicts,omitempty"`
	Rejects   []string `json:"rejects,omitempty"`
}

// recordUnresolved adds a pull's leftovers to the record.
func recordUnresolved(r repo, u unresolved) error {
	path := filepath.Join(r.stateDir(), unresolvedFile)
	var all []unresolved
	if b, err := os.ReadFile(path); err == nil {
		_ = json.Unmarshal(b, &all) // a damaged record only loses old warnings
	}
	all = append(all, u)
	b, err := json.MarshalIndent(all, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return fmt.Errorf("record unresolved conflicts: %w", err)
	}
	return os.Rename(tmp, path)
}

// unresolvedWarning names leftover .rej files (recorded by an earlier pull,
// or any untracked *.rej among added) and files still holding the conflict
// markers a pull wrote. It reads only the files it names.
func unresolvedWarning(r repo, added []string) string {
	rejects := map[string]bool{}
	conflicts := map[string]bool{}
	var patches []string
	path := filepath.Join(r.stateDir(), unresolvedFile)
	if b, err := os.ReadFile(path); err == nil {
		var all, keep []unresolved
		if json.Unmarshal(b, &all) == nil {
			for _, u := range all {
				live := false
				for _, f := range u.Rejects {
					if _, err := os.Lstat(filepath.Join(r.root, f)); err == nil {
						rejects[f], live = true, true
					}
				}
				for _, f := range u.Conflicts {
					if hasConflictMarkers(filepath.Join(r.root, f)) {
						conflicts[f], live = true, true
					}
				}
				if live {
					keep = append(keep, u)
					if u.Patch != "" {
						patches = append(patches, u.Patch)
					}
				}
			}
		}
		// Forget what the user resolved, so the record stays small.
		if len(keep) == 0 {
			_ = os.Remove(path)
		} else if len(keep) < len(all) {
			if b, err := json.MarshalIndent(keep, "", "  "); err == nil {
				_ = os.WriteFile(path, b, 0o644)
			}
		}
	}
	for _, f := range added {
		if strings.HasSuffix(f, ".rej") {
			rejects[f] = true
		}
	}
	if len(rejects) == 0 && len(conflicts) == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteString("unresolved results of an earlier pull from the sandbox:")
	if len(rejects) > 0 {
		fmt.Fprintf(&b, " .rej files %s;", strings.Join(sortedKeys(rejects), ", "))
	}
	if len(conflicts) > 0 {
		fmt.Fprintf(&b, " conflict markers in %s;", strings.Join(sortedKeys(conflicts), ", "))
	}
	if len(patches) > 0 {
		fmt.Fprintf(&b, " full patch at %s;", strings.Join(patches, ", "))
	}
	if len(rejects) > 0 {
		b.WriteString(" they are synced to the sandbox as they are: resolve them and delete the .rej files")
	} else {
		b.WriteString(" they are synced to the sandbox as they are: resolve the conflicts (remove the markers)")
	}
	return b.String()
}

func hasConflictMarkers(path string) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if bytes.HasPrefix(sc.Bytes(), []byte("<<<<<<< ours")) {
			return true
		}
	}
	return false
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

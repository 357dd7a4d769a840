package store

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// FuzzLegacyFile: any .rwx/sandboxes/sandboxes.json (the RWX CLI's file,
// which sandboxd reads from every repository it sees) is either parsed or
// refused as malformed, never a panic; what parses is sorted by key, every
// entry has a branch, and importing it into a real store either works or
// fails with an error, leaving the store consistent.
func FuzzLegacyFile(f *testing.F) {
	for _, s := range []string{
		`{"sandboxes":{"/src/r:main:/src/r/.rwx/sandbox.yml":{"runId":"run-1","configFile":"/src/r/.rwx/sandbox.yml","createdAt":"2025-03-01T10:00:00Z","execCount":3}}}`,
		`{"version":1,"sandboxes":{"main:/r/.rwx/sandbox.yml":{"runId":"a"},"detached@abc:/r/x.yml":{"runId":"b"},":/r/y.yml":{"runId":"c"},"topic:":{"runId":"d","configFile":".rwx/s.yml"}}}`,
		`{"version":0,"sandboxes":{"/a/b:feature/x:rel.yaml":{"runId":"e","configFile":"rel.yaml"},"::":{},"":{"runId":"f"}}}`,
		`{"sandboxes":{"k":{"runId":"x","createdAt":"not a time"}}}`,
		`{"sandboxes":null}`,
		`{"sandboxes":[]}`,
		`[]`,
		``,
		`{"version":1e400}`,
	} {
		f.Add([]byte(s))
	}
	dir := f.TempDir()
	st, err := Open(context.Background(), filepath.Join(dir, "fuzz.db"), Options{LockTimeout: time.Second})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { st.Close() })
	st.db.NoSync = true // a throwaway file: fsync would make each input cost milliseconds
	var n int
	f.Fuzz(func(t *testing.T, data []byte) {
		n++
		repo := filepath.Join(dir, "repo", strings.Repeat("r", n%7)+string(rune('a'+n%26)))
		path := filepath.Join(t.TempDir(), "sandboxes.json")
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := ReadLegacyFile(path)
		if err != nil {
			if !errors.Is(err, ErrLegacyMalformed) || !strings.Contains(err.Error(), path) {
				t.Fatalf("a bad file must be reported as malformed, naming it: %v", err)
			}
			return
		}
		if !slices.IsSortedFunc(got, func(a, b LegacySession) int { return strings.Compare(a.Key, b.Key) }) {
			t.Fatal("entries not sorted by key")
		}
		for _, ls := range got {
			if ls.Branch == "" {
				t.Fatalf("entry %q without a branch", ls.Key)
			}
			if ls.Cwd != "" && !filepath.IsAbs(ls.Cwd) {
				t.Fatalf("entry %q: relative cwd %q", ls.Key, ls.Cwd)
			}
		}
		toIdentity := func(ls LegacySession) (Identity, bool) {
			cfg := ls.ConfigFile
			if !filepath.IsAbs(cfg) {
				cfg = filepath.Join(repo, cfg)
			}
			return Identity{RepoRoot: repo, Branch: ls.Branch, ConfigFile: cfg}, true
		}
		if _, err := st.AdoptLegacy(got, toIdentity, "local"); err != nil && err.Error() == "" {
			t.Fatal("an adoption error without a message")
		}
		if err := st.Verify(); err != nil {
			t.Fatalf("the store is inconsistent after importing %q: %v", data, err)
		}
	})
}

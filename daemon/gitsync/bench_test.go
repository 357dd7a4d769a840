package gitsync

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// BenchmarkPrepareOneFileChange measures the local half of a push for a
// repository of 1,000 files with one file edited: what every synced exec
// pays before its one push request.
func BenchmarkPrepareOneFileChange(b *testing.B) {
	isolate(b)
	dir := filepath.Join(b.TempDir(), "repo")
	git(b, filepath.Dir(dir), "init", "-q", "-b", "main", dir)
	for i := 0; i < 1000; i++ {
		writeFile(b, filepath.Join(dir, fmt.Sprintf("pkg%02d/file%04d.go", i%20, i)), fmt.Sprintf("package pkg\n\n// file %d\nvar X%d = %d\n", i, i, i))
	}
	git(b, dir, "add", "-A")
	git(b, dir, "commit", "-q", "-m", "base")
	base := strings.TrimSpace(git(b, dir, "rev-parse", "HEAD"))
	git(b, dir, "status", "-s") // refresh the index's stat data, as a user's git would
	writeFile(b, filepath.Join(dir, "pkg03/file0003.go"), "package pkg\n\n// edited\n")
	s := New(Options{})
	ctx := context.Background()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		p, err := s.Prepare(ctx, dir, base)
		if err != nil {
			b.Fatal(err)
		}
		if len(p.Files) != 1 {
			b.Fatalf("files %v", p.Files)
		}
	}
}

// BenchmarkSyncedExecOneFileChange measures the sync of one exec end to end
// (prepare, push, pull with one file coming back) with the sandbox on this
// machine and /bin/sh standing in for the SSH exec request: the sync's own
// cost, without network round trips.
func BenchmarkSyncedExecOneFileChange(b *testing.B) {
	isolate(b)
	root := b.TempDir()
	local, sandbox := filepath.Join(root, "local"), filepath.Join(root, "sandbox")
	git(b, root, "init", "-q", "-b", "main", local)
	for i := 0; i < 1000; i++ {
		writeFile(b, filepath.Join(local, fmt.Sprintf("pkg%02d/file%04d.go", i%20, i)), fmt.Sprintf("package pkg\n\nvar X%d = %d\n", i, i))
	}
	git(b, local, "add", "-A")
	git(b, local, "commit", "-q", "-m", "base")
	git(b, root, "clone", "-q", local, sandbox)
	base := strings.TrimSpace(git(b, local, "rev-parse", "HEAD"))
	git(b, local, "status", "-s")
	writeFile(b, filepath.Join(local, "pkg03/file0003.go"), "package pkg\n\n// edited\n")
	s := New(Options{})
	r := &sandboxRunner{dir: sandbox}
	ctx := context.Background()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		p, err := s.Prepare(ctx, local, base)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := s.Push(ctx, r, p); err != nil {
			b.Fatal(err)
		}
		// The command's edit, undone locally after the pull so every
		// iteration moves the same bytes.
		writeFile(b, filepath.Join(sandbox, "out.txt"), "result\n")
		if res, err := s.Pull(ctx, r, local); err != nil || len(res.Files) != 1 {
			b.Fatalf("pull: %v %v", res.Files, err)
		}
		b.StopTimer()
		if err := os.Remove(filepath.Join(local, "out.txt")); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}

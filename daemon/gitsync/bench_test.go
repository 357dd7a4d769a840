package gitsync

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

// benchSizes are the repository sizes of the table: a one-file
// change must cost the same in all of them.
var benchSizes = []int{200, 5000, 50000}

// benchFullScan measures without the change tracker, for comparison.
var benchFullScan = os.Getenv("BENCH_FULL_SCAN") == "1"

// benchRepo commits n small files, 20 to a directory, two levels deep,
// and refreshes the index as a user's git would.
func benchRepo(b *testing.B, dir string, n int) string {
	b.Helper()
	testutil.Git(b, filepath.Dir(dir), "init", "-q", "-b", "main", dir)
	for i := 0; i < n; i++ {
		writeFile(b, filepath.Join(dir, benchPath(i)), fmt.Sprintf("package pkg\n\n// file %d\nvar X%d = %d\n", i, i, i))
	}
	testutil.Git(b, dir, "add", "-A")
	testutil.Git(b, dir, "commit", "-q", "-m", "base")
	testutil.Git(b, dir, "status", "-s")
	return strings.TrimSpace(testutil.Git(b, dir, "rev-parse", "HEAD"))
}

func benchPath(i int) string {
	d := i / 20
	return fmt.Sprintf("pkg%03d/sub%03d/file%05d.go", d/50, d%50, i)
}

// BenchmarkPrepareOneFileChange measures the local half of a push with one
// file edited before each Prepare: what every synced exec pays before its
// push request, at 200, 5,000 and 50,000 files.
func BenchmarkPrepareOneFileChange(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(fmt.Sprintf("files=%d", n), func(b *testing.B) {
			isolate(b)
			dir := filepath.Join(b.TempDir(), "repo")
			base := benchRepo(b, dir, n)
			s := newBenchSyncer(b)
			ctx := context.Background()
			edited := filepath.Join(dir, benchPath(n/2))
			writeFile(b, edited, "package pkg\n\n// edited\n")
			if _, err := s.Prepare(ctx, dir, base); err != nil { // the first one scans
				b.Fatal(err)
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				writeFile(b, edited, fmt.Sprintf("package pkg\n\n// edited %d\n", i))
				b.StartTimer()
				p, err := s.Prepare(ctx, dir, base)
				if err != nil {
					b.Fatal(err)
				}
				if len(p.Files) != 1 {
					b.Fatalf("files %v", p.Files)
				}
			}
		})
	}
}

// BenchmarkPrepareNoChange measures Prepare when nothing changed since the
// previous one.
func BenchmarkPrepareNoChange(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(fmt.Sprintf("files=%d", n), func(b *testing.B) {
			isolate(b)
			dir := filepath.Join(b.TempDir(), "repo")
			base := benchRepo(b, dir, n)
			writeFile(b, filepath.Join(dir, benchPath(n/2)), "package pkg\n\n// edited\n")
			s := newBenchSyncer(b)
			ctx := context.Background()
			if _, err := s.Prepare(ctx, dir, base); err != nil { // the first one scans
				b.Fatal(err)
			}
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
		})
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
	testutil.Git(b, root, "init", "-q", "-b", "main", local)
	for i := 0; i < 1000; i++ {
		writeFile(b, filepath.Join(local, fmt.Sprintf("pkg%02d/file%04d.go", i%20, i)), fmt.Sprintf("package pkg\n\nvar X%d = %d\n", i, i))
	}
	testutil.Git(b, local, "add", "-A")
	testutil.Git(b, local, "commit", "-q", "-m", "base")
	testutil.Git(b, root, "clone", "-q", local, sandbox)
	base := strings.TrimSpace(testutil.Git(b, local, "rev-parse", "HEAD"))
	testutil.Git(b, local, "status", "-s")
	writeFile(b, filepath.Join(local, "pkg03/file0003.go"), "package pkg\n\n// edited\n")
	s := newBenchSyncer(b)
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

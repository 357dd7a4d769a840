package repofile

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
)

func write(t *testing.T, path, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

// readSoon fails the test when a read does not return promptly: a read of
// /dev/zero or a FIFO must never block or run unbounded.
func readSoon(t *testing.T, root, name string, limit int64) ([]byte, error) {
	t.Helper()
	type res struct {
		b   []byte
		err error
	}
	done := make(chan res, 1)
	go func() {
		b, err := ReadFile(context.Background(), root, name, limit)
		done <- res{b, err}
	}()
	select {
	case r := <-done:
		return r.b, r.err
	case <-time.After(20 * time.Second):
		t.Fatalf("reading %s did not return", name)
		return nil, nil
	}
}

func TestReadFileRefusesWhatIsNotARegularFileOfTheRepository(t *testing.T) {
	root := t.TempDir()
	outside := t.TempDir()
	write(t, filepath.Join(root, ".rwx", "sandbox.yml"), "tasks: []\n")
	write(t, filepath.Join(outside, "secret"), "password\n")
	write(t, filepath.Join(root, "lib", "real.yml"), "x: 1\n")
	mustSymlink(t, "/dev/zero", filepath.Join(root, ".rwx", "zero.yml"))
	mustSymlink(t, filepath.Join(outside, "secret"), filepath.Join(root, ".rwx", "secret.yml"))
	mustSymlink(t, "../../"+filepath.Base(outside)+"/secret", filepath.Join(root, ".rwx", "relsecret.yml"))
	mustSymlink(t, "../lib/real.yml", filepath.Join(root, ".rwx", "inside.yml"))
	if err := syscall.Mkfifo(filepath.Join(root, ".rwx", "fifo.yml"), 0o644); err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(root, ".rwx", "big.yml"), strings.Repeat("x", MaxFileBytes+1))

	if b, err := readSoon(t, root, filepath.Join(root, ".rwx", "sandbox.yml"), MaxFileBytes); err != nil || string(b) != "tasks: []\n" {
		t.Fatalf("a config: %q, %v", b, err)
	}
	if b, err := readSoon(t, root, ".rwx/inside.yml", MaxFileBytes); err != nil || string(b) != "x: 1\n" {
		t.Fatalf("a link inside the repository: %q, %v", b, err)
	}
	for _, c := range []struct {
		name, want string
		kind       errdefs.Kind
	}{
		{".rwx/zero.yml", "outside the repository", errdefs.KindInvalid},
		{".rwx/secret.yml", "outside the repository", errdefs.KindInvalid},
		{".rwx/relsecret.yml", "outside the repository", errdefs.KindInvalid},
		{".rwx/fifo.yml", "not a regular file", errdefs.KindInvalid},
		{".rwx", "is a directory", errdefs.KindInvalid},
		{".rwx/big.yml", "1024 KiB limit", errdefs.KindTooLarge},
		{filepath.Join(outside, "secret"), "outside the repository", errdefs.KindInvalid},
		{"../" + filepath.Base(outside) + "/secret", "outside the repository", errdefs.KindInvalid},
	} {
		b, err := readSoon(t, root, c.name, MaxFileBytes)
		if err == nil || errdefs.KindOf(err) != c.kind || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want %v saying %q", c.name, err, c.kind, c.want)
		}
		if b != nil {
			t.Errorf("%s: read %d bytes", c.name, len(b))
		}
	}
	if _, err := readSoon(t, root, ".rwx/missing.yml", MaxFileBytes); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a missing file: %v", err)
	}
}

func TestReadDirUploadsOnlyTheRepositorysRegularFiles(t *testing.T) {
	root := t.TempDir()
	outside := t.TempDir()
	dir := filepath.Join(root, ".rwx")
	write(t, filepath.Join(dir, "sandbox.yml"), "tasks: []\n")
	write(t, filepath.Join(dir, "lib", "steps.yml"), "x\n")
	write(t, filepath.Join(dir, "sandboxes", "sandboxes.json"), "{}")
	write(t, filepath.Join(root, "shared.yml"), "shared\n")
	mustSymlink(t, "../shared.yml", filepath.Join(dir, "shared.yml"))
	mustSymlink(t, "missing", filepath.Join(dir, "dangling.yml"))
	if err := syscall.Mkfifo(filepath.Join(dir, "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	entries, err := ReadDir(context.Background(), root, dir, "sandboxes")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range entries {
		got = append(got, e.Path+"="+string(e.Data))
	}
	if s := strings.Join(got, ","); s != "lib=,lib/steps.yml=x\n,sandbox.yml=tasks: []\n,shared.yml=shared\n" {
		t.Fatalf("entries = %q", s)
	}

	write(t, filepath.Join(outside, "secret"), "password\n")
	mustSymlink(t, filepath.Join(outside, "secret"), filepath.Join(dir, "secret.yml"))
	if _, err := ReadDir(context.Background(), root, dir, "sandboxes"); !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "secret.yml leads to") {
		t.Fatalf("a link leading outside: %v", err)
	}
	os.Remove(filepath.Join(dir, "secret.yml"))
	mustSymlink(t, "/dev/zero", filepath.Join(dir, "zero.yml"))
	if _, err := ReadDir(context.Background(), root, dir, "sandboxes"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("a link to /dev/zero: %v", err)
	}
	os.Remove(filepath.Join(dir, "zero.yml"))

	for i := range 6 {
		write(t, filepath.Join(dir, "big", string(rune('a'+i))), strings.Repeat("x", MaxFileBytes-10))
	}
	if _, err := ReadDir(context.Background(), root, dir, "sandboxes"); !errors.Is(err, errdefs.ErrTooLarge) || !strings.Contains(err.Error(), "5 MiB") {
		t.Fatalf("an oversized directory: %v", err)
	}
}

func mustSymlink(t *testing.T, target, link string) {
	t.Helper()
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
}

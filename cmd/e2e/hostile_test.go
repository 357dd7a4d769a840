package e2e

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestHostileConfigFilesAreRefused: a repository is untrusted input (a
// cloned one may commit any symlink). Configs and the .rwx directory are
// read only as regular files inside the repository, within a size limit,
// and never block: a link to /dev/zero, a FIFO, a link to a secret outside
// the repository, a directory or a huge file each get a clear 4xx error, and
// nothing outside the repository reaches the remote.
func TestHostileConfigFilesAreRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("hostile", defaultConfig)
	secretDir := filepath.Join(e.root, "private")
	writeFile(t, filepath.Join(secretDir, "secret"), "TOPSECRET\n")
	rwx := filepath.Join(repo, ".rwx")
	must(t, os.Symlink("/dev/zero", filepath.Join(rwx, "zero.yml")))
	must(t, os.Symlink(filepath.Join(secretDir, "secret"), filepath.Join(rwx, "secret.yml")))
	must(t, syscall.Mkfifo(filepath.Join(rwx, "fifo.yml"), 0o644))
	writeFile(t, filepath.Join(repo, "configs", "big.yml"), defaultConfig+"#"+strings.Repeat("x", 2<<20)+"\n")
	writeFile(t, filepath.Join(repo, "configs", "sub", "sandbox.yml"), defaultConfig)
	for _, c := range []struct {
		config string
		code   int
		want   string
	}{
		{".rwx/zero.yml", 400, "outside the repository"},
		{".rwx/secret.yml", 400, "outside the repository"},
		{".rwx/fifo.yml", 400, "not a regular file"},
		{".rwx", 400, "is a directory"},
		{"configs/big.yml", 413, "KiB limit"},
	} {
		body, err := e.api("POST", "/v1/sessions/start", map[string]any{"cwd": repo, "configFile": c.config})
		var se *statusError
		if !errors.As(err, &se) || se.code != c.code || !strings.Contains(se.body, c.want) {
			t.Errorf("start with %s: %v %s; want %d saying %q", c.config, err, body, c.code, c.want)
		}
	}
	if r := e.nook(repo, "start", ".rwx/zero.yml"); r.code == 0 || !strings.Contains(r.stderr, "outside the repository") {
		t.Errorf("nook start of a link to /dev/zero: %s", r)
	}

	// A link in the uploaded directory leading outside refuses the start,
	// naming the link; once it is gone the start works, and the remote never
	// saw the secret.
	must(t, os.Remove(filepath.Join(rwx, "zero.yml")))
	must(t, os.Remove(filepath.Join(rwx, "secret.yml")))
	must(t, os.Symlink(filepath.Join(secretDir, "secret"), filepath.Join(rwx, "leak.yml")))
	if r := e.nook(repo, "start"); r.code == 0 || !strings.Contains(r.stderr, "leak.yml") || !strings.Contains(r.stderr, "outside the repository") {
		t.Fatalf("start with a link to a secret in .rwx: %s", r)
	}
	must(t, os.Remove(filepath.Join(rwx, "leak.yml")))
	e.mustNook(repo, "start", "configs/sub/sandbox.yml")
	e.startSandbox(repo)
	_ = filepath.Walk(filepath.Join(e.get("XDG_DATA_HOME"), "sandboxd", "localcloud"), func(p string, info os.FileInfo, err error) error {
		if err == nil && info.Mode().IsRegular() && info.Size() < 64<<20 {
			if b, _ := os.ReadFile(p); strings.Contains(string(b), "TOPSECRET") {
				t.Errorf("the secret outside the repository reached the remote: %s", p)

			}
		}
		return nil
	})
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

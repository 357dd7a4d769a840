package clifile

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// cliWritten is a file as the RWX CLI (2026-08) writes it, byte for byte,
// with a field this package does not know in the second record.
const cliWritten = `{
  "version": 1,
  "sandboxes": {
    "feat:/src/app/.rwx/sandbox.yml": {
      "runId": "r2",
      "configFile": "/src/app/.rwx/sandbox.yml",
      "runUrl": "https://cloud/runs/r2",
      "futureField": {
        "a": [
          1,
          2
        ]
      }
    },
    "main:/src/app/.rwx/sandbox.yml": {
      "runId": "r1",
      "configFile": "/src/app/.rwx/sandbox.yml",
      "scopedToken": "tok",
      "runUrl": "https://cloud/runs/r1",
      "configHash": "2ac1",
      "createdAt": "2026-11-23T07:09:44.523404553Z"
    }
  }
}
`

func TestRoundTripIsByteForByte(t *testing.T) {
	f, err := Parse("x", []byte(cliWritten))
	if err != nil {
		t.Fatal(err)
	}
	out, err := f.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if string(out) != cliWritten {
		t.Fatalf("rewritten file differs:\n%s", out)
	}
	e, ok, err := f.Get("main:/src/app/.rwx/sandbox.yml")
	if err != nil || !ok || e.RunID != "r1" || e.ScopedToken != "tok" || e.CreatedAt == nil || e.CreatedAt.Nanosecond() != 523404553 {
		t.Fatalf("Get = %+v, %v, %v", e, ok, err)
	}
}

func TestSetKeepsOtherRecordsAndCLIFormat(t *testing.T) {
	f, err := Parse("x", []byte(cliWritten))
	if err != nil {
		t.Fatal(err)
	}
	created := time.Date(2026, 11, 23, 8, 0, 0, 5, time.UTC)
	key, err := Key("dev", "/src/app/.rwx/sandbox.yml")
	if err != nil {
		t.Fatal(err)
	}
	f.Set(key, Entry{RunID: "r3", ConfigFile: "/src/app/.rwx/sandbox.yml", RunURL: "u3", ConfigHash: "h", CreatedAt: &created})
	f.Delete("main:/src/app/.rwx/sandbox.yml")
	out, _ := f.Marshal()
	want := strings.Replace(cliWritten, `    "main:/src/app/.rwx/sandbox.yml": {
      "runId": "r1",
      "configFile": "/src/app/.rwx/sandbox.yml",
      "scopedToken": "tok",
      "runUrl": "https://cloud/runs/r1",
      "configHash": "2ac1",
      "createdAt": "2026-11-23T07:09:44.523404553Z"
    }
`, ``, 1)
	want = strings.Replace(want, `  "sandboxes": {
`, `  "sandboxes": {
    "dev:/src/app/.rwx/sandbox.yml": {
      "runId": "r3",
      "configFile": "/src/app/.rwx/sandbox.yml",
      "runUrl": "u3",
      "configHash": "h",
      "createdAt": "2026-11-23T08:00:00.000000005Z"
    },
`, 1)
	want = strings.Replace(want, "      }\n    },\n  }", "      }\n    }\n  }", 1)
	if string(out) != want {
		t.Fatalf("got:\n%s\nwant:\n%s", out, want)
	}
}

func TestKeys(t *testing.T) {
	if _, err := Key("main", ".rwx/sandbox.yml"); err == nil {
		t.Fatal("a relative config made a key: the CLI panics on such keys")
	}
	if k, _ := Key("", "/a/b.yml"); k != "detached:/a/b.yml" {
		t.Fatalf("Key = %q", k)
	}
	for key, want := range map[string][2]string{
		"feature/x:/a/.rwx/sandbox.yml":        {"feature/x", "/a/.rwx/sandbox.yml"},
		"detached@abc1234:/a/.rwx/sandbox.yml": {"detached@abc1234", "/a/.rwx/sandbox.yml"},
		"main:.rwx/sandbox.yml":                {"main", ".rwx/sandbox.yml"},
		"main":                                 {"main", ""},
	} {
		if b, c := ParseKey(key); b != want[0] || c != want[1] {
			t.Errorf("ParseKey(%q) = %q, %q", key, b, c)
		}
	}
}

func TestVersion0KeysAreMigratedLikeTheCLI(t *testing.T) {
	f, err := Parse("x", []byte(`{"sandboxes":{
	  "/src/app:main:/src/app/.rwx/sandbox.yml": {"runId":"a","configFile":"/src/app/.rwx/sandbox.yml"},
	  "/src/app/sub:dev:.rwx/other.yml": {"runId":"b","configFile":".rwx/other.yml"},
	  "topic:/src/app/.rwx/sandbox.yml": {"runId":"c","configFile":"/src/app/.rwx/sandbox.yml"}
	}}`))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"dev:/src/app/sub/.rwx/other.yml", "main:/src/app/.rwx/sandbox.yml", "topic:/src/app/.rwx/sandbox.yml"}
	if got := f.Keys(); strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("keys = %q, want %q", got, want)
	}
	out, _ := f.Marshal()
	if !strings.HasPrefix(string(out), "{\n  \"version\": 1,\n") {
		t.Fatalf("a rewritten file must say version 1 (its keys are migrated):\n%s", out)
	}
}

func TestMalformedAndEmpty(t *testing.T) {
	f, err := Parse("none", nil)
	if err != nil || len(f.Keys()) != 0 {
		t.Fatalf("no file = %v, %v", f, err)
	}
	if _, err := Parse("/r/x.json", []byte("{not json")); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "/r/x.json") {
		t.Fatalf("malformed file: %v", err)
	}
}

func TestWriteIsAtomicWithGitignore(t *testing.T) {
	repo := t.TempDir()
	f, _ := Parse("", nil)
	key, _ := Key("main", filepath.Join(repo, ".rwx", "sandbox.yml"))
	f.Set(key, Entry{RunID: "r", ConfigFile: filepath.Join(repo, ".rwx", "sandbox.yml")})
	if err := f.Write(repo); err != nil {
		t.Fatal(err)
	}
	path := Path(repo)
	if b, err := os.ReadFile(filepath.Join(filepath.Dir(path), ".gitignore")); err != nil || string(b) != "*\n" {
		t.Fatalf(".gitignore = %q, %v", b, err)
	}
	data, _ := os.ReadFile(path)
	got, err := Parse(path, data)
	if err != nil {
		t.Fatal(err)
	}
	if e, ok, _ := got.Get(key); !ok || e.RunID != "r" {
		t.Fatalf("read back %+v", e)
	}
	if st, _ := os.Stat(path); st.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v, want 0600 as the CLI's", st.Mode())
	}
	left, _ := filepath.Glob(filepath.Join(filepath.Dir(path), ".sandboxes-*"))
	if len(left) != 0 {
		t.Fatalf("temporary files left: %v", left)
	}
}

// TestStaysInsideTheRepository: a checkout whose .rwx/sandboxes leads out
// of it through a symlink, or whose lock is a FIFO, gets an error, never a
// write elsewhere or a hang.
func TestStaysInsideTheRepository(t *testing.T) {
	repo, outside := t.TempDir(), t.TempDir()
	os.MkdirAll(filepath.Join(repo, ".rwx"), 0o755)
	if err := os.Symlink(outside, filepath.Join(repo, ".rwx", "sandboxes")); err != nil {
		t.Fatal(err)
	}
	f, _ := Parse("", nil)
	f.Set("main:/x.yml", Entry{RunID: "r"})
	if err := f.Write(repo); err == nil {
		t.Fatal("wrote through a symlink leaving the repository")
	}
	if _, err := Lock(context.Background(), repo); err == nil {
		t.Fatal("locked through a symlink leaving the repository")
	}
	if left, _ := os.ReadDir(outside); len(left) != 0 {
		t.Fatalf("files created outside the repository: %v", left)
	}

	fifoRepo := t.TempDir()
	os.MkdirAll(filepath.Dir(Path(fifoRepo)), 0o755)
	if err := syscall.Mkfifo(Path(fifoRepo)+".lock", 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := Lock(ctx, fifoRepo); err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a FIFO as the lock: %v, want a clear error at once", err)
	}
}

// TestLockWaitsForTheCLI: while another open file description holds the
// flock (as a CLI process does), Lock waits; it gets the lock once that is
// released, and gives up when its context ends.
func TestLockWaitsForTheCLI(t *testing.T) {
	repo := t.TempDir()
	path := Path(repo)
	os.MkdirAll(filepath.Dir(path), 0o755)
	cli, err := os.OpenFile(path+".lock", os.O_CREATE|os.O_RDONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if err := syscall.Flock(int(cli.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := Lock(ctx, repo); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Lock while the CLI holds it = %v, want a deadline error", err)
	}
	got := make(chan func(), 1)
	go func() {
		unlock, err := Lock(context.Background(), repo)
		if err != nil {
			t.Error(err)
		}
		got <- unlock
	}()
	select {
	case <-got:
		t.Fatal("Lock did not wait for the CLI's lock")
	case <-time.After(50 * time.Millisecond):
	}
	syscall.Flock(int(cli.Fd()), syscall.LOCK_UN)
	unlock := <-got
	// Now the CLI must wait for us.
	if err := syscall.Flock(int(cli.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err == nil {
		t.Fatal("the CLI got the lock while sandboxd held it")
	}
	unlock()
	if err := syscall.Flock(int(cli.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		t.Fatalf("the CLI cannot lock after unlock: %v", err)
	}
}

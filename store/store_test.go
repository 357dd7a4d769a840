package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
)

func TestMain(m *testing.M) {
	if path := os.Getenv(crashChildEnv); path != "" {
		os.Exit(crashChild(path))
	}
	os.Exit(m.Run())
}

// fakeClock is an injectable clock that only moves when told.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// isolate keeps tests away from the real user's state.
func isolate(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	for _, v := range []string{"HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_RUNTIME_DIR"} {
		t.Setenv(v, dir)
	}
	return dir
}

func openTest(t testing.TB, path string, clock *fakeClock) *Store {
	t.Helper()
	opts := Options{LockTimeout: 200 * time.Millisecond}
	if clock != nil {
		opts.Now = clock.Now
	}
	s, err := Open(context.Background(), path, opts)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func newTestStore(t testing.TB) (*Store, *fakeClock) {
	t.Helper()
	dir := isolate(t)
	clock := newFakeClock()
	return openTest(t, filepath.Join(dir, "state", "sandboxd", "sandboxd.db"), clock), clock
}

func ident(branch string) Identity {
	return Identity{RepoRoot: "/src/repo", Branch: branch, ConfigFile: "/src/repo/.rwx/sandbox.yml"}
}

func mustVerify(t testing.TB, s *Store) {
	t.Helper()
	if err := s.Verify(); err != nil {
		t.Fatalf("Verify: %v", err)
	}
}

func TestOpenCreatesPrivateDirAndFile(t *testing.T) {
	dir := isolate(t)
	path := filepath.Join(dir, "a", "b", "sandboxd.db")
	s := openTest(t, path, nil)
	if s.Path() != path {
		t.Fatalf("Path() = %q, want %q", s.Path(), path)
	}
	for p, want := range map[string]os.FileMode{filepath.Dir(path): 0o700, path: 0o600} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode().Perm(); got != want {
			t.Errorf("%s mode = %v, want %v", p, got, want)
		}
	}
	if err := s.Ping(); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Ping(); err == nil {
		t.Fatal("Ping after Close succeeded")
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	// Reopening an existing v1 store keeps it as is.
	s = openTest(t, path, nil)
	if v, err := s.schemaVersion(); err != nil || v != CurrentSchemaVersion {
		t.Fatalf("schema version = %d, %v", v, err)
	}
}

func TestOpenRestrictsAWorldReadableFile(t *testing.T) {
	dir := isolate(t)
	path := filepath.Join(dir, "sandboxd.db")
	s := openTest(t, path, nil)
	_ = s.Close()
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	openTest(t, path, nil)
	fi, _ := os.Stat(path)
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode = %v, want 0600", fi.Mode().Perm())
	}
}

func TestOpenCanceledContext(t *testing.T) {
	dir := isolate(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Open(ctx, filepath.Join(dir, "x.db"), Options{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
}

func TestSecondOpenFailsFastWithErrLocked(t *testing.T) {
	dir := isolate(t)
	path := filepath.Join(dir, "sandboxd.db")
	first := openTest(t, path, nil)

	start := time.Now()
	_, err := Open(context.Background(), path, Options{LockTimeout: 100 * time.Millisecond})
	if !errors.Is(err, ErrLocked) {
		t.Fatalf("second Open: err = %v, want ErrLocked", err)
	}
	var locked *LockedError
	if !errors.As(err, &locked) || locked.Path != path || !strings.Contains(err.Error(), path) {
		t.Fatalf("error %v does not name the file", err)
	}
	if waited := time.Since(start); waited > 5*time.Second {
		t.Fatalf("second Open took %s", waited)
	}
	// The holder is unaffected and, once it closes, the file opens.
	if err := first.Ping(); err != nil {
		t.Fatal(err)
	}
	_ = first.Close()
	openTest(t, path, nil)
}

func assertCorruptUntouched(t *testing.T, path string, before []byte) {
	t.Helper()
	_, err := Open(context.Background(), path, Options{LockTimeout: 100 * time.Millisecond})
	if !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Open: err = %v, want ErrCorrupt", err)
	}
	var ce *CorruptError
	if !errors.As(err, &ce) || ce.Path != path {
		t.Fatalf("error %v: want a *CorruptError for %s", err, path)
	}
	if msg := err.Error(); !strings.Contains(msg, path) || !strings.Contains(msg, "move it aside") {
		t.Fatalf("message %q should name the file and say to move it aside", msg)
	}
	after, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(before, after) {
		t.Fatal("the corrupt file was modified")
	}
	// The failed Open released the lock: nothing keeps the file busy.
	if _, err2 := Open(context.Background(), path, Options{LockTimeout: 100 * time.Millisecond}); errors.Is(err2, ErrLocked) {
		t.Fatal("a failed Open kept the lock")
	}
}

func TestCorruptFileIsReportedAndLeftUntouched(t *testing.T) {
	cases := map[string]func(t *testing.T, path string){
		"text": func(t *testing.T, path string) {
			must(t, os.WriteFile(path, []byte("this is not a database\n"), 0o600))
		},
		"garbage pages": func(t *testing.T, path string) {
			b := bytes.Repeat([]byte{0xde, 0xad, 0xbe, 0xef}, 4*4096)
			must(t, os.WriteFile(path, b, 0o600))
		},
		"damaged data pages": func(t *testing.T, path string) {
			s, _ := Open(context.Background(), path, Options{})
			for i := range 200 {
				must(t, s.Insert(&Session{Identity: ident(fmt.Sprint("b", i)), RunID: fmt.Sprint("run-", i), State: StateReady}))
			}
			must(t, s.Close())
			b, err := os.ReadFile(path)
			must(t, err)
			// Keep both meta pages (valid checksums), scribble over the rest.
			for i := 2 * 4096; i < len(b); i++ {
				b[i] = byte(i * 7)
			}
			must(t, os.WriteFile(path, b, 0o600))
		},
		"foreign bbolt file": func(t *testing.T, path string) {
			db, err := bolt.Open(path, 0o600, nil)
			must(t, err)
			must(t, db.Update(func(tx *bolt.Tx) error { _, err := tx.CreateBucket([]byte("other-app")); return err }))
			must(t, db.Close())
		},
		"bad schema version": func(t *testing.T, path string) {
			s, _ := Open(context.Background(), path, Options{})
			must(t, s.Close())
			setRaw(t, path, bucketMeta, keySchemaVersion, []byte("banana"))
		},
		"missing index bucket": func(t *testing.T, path string) {
			s, _ := Open(context.Background(), path, Options{})
			must(t, s.Close())
			db, err := bolt.Open(path, 0o600, nil)
			must(t, err)
			must(t, db.Update(func(tx *bolt.Tx) error { return tx.DeleteBucket(bucketByRun) }))
			must(t, db.Close())
		},
	}
	for name, setup := range cases {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(isolate(t), "sandboxd.db")
			setup(t, path)
			before, err := os.ReadFile(path)
			must(t, err)
			assertCorruptUntouched(t, path, before)
		})
	}
}

// A file cut short (a full disk, a bad copy) must be reported like any
// other damage: bbolt would map it and fault (SIGBUS) reading pages past
// its end.
func TestTruncatedFileIsReportedAndLeftUntouched(t *testing.T) {
	// A small store fits bbolt's first 32 KiB mapping: pages cut off inside
	// it are the SIGBUS of the report; a larger one is cut anywhere before
	// its last page.
	for _, sessions := range []int{3, 300} {
		full := filepath.Join(isolate(t), "full.db")
		s, err := Open(context.Background(), full, Options{})
		must(t, err)
		for i := range sessions {
			must(t, s.Insert(&Session{Identity: ident(fmt.Sprint("b", i)), RunID: fmt.Sprint("run-", i), State: StateReady}))
		}
		must(t, s.Close())
		b, err := os.ReadFile(full)
		must(t, err)
		m, ok := parseBoltMeta(b)
		if !ok {
			t.Fatal("no valid meta page in a fresh store")
		}
		used := int(m.pgid) * int(m.pageSize)
		sizes := []int{used - 100}
		for size := 8 << 10; size < used && size <= 64<<10; size += 4 << 10 {
			sizes = append(sizes, size)
		}
		for _, size := range sizes {
			t.Run(fmt.Sprint(sessions, "sessions/", size), func(t *testing.T) {
				path := filepath.Join(isolate(t), "sandboxd.db")
				must(t, os.WriteFile(path, b[:size], 0o600))
				assertCorruptUntouched(t, path, b[:size])
			})
		}
	}
}

func TestCorruptRecordIsReportedByReads(t *testing.T) {
	path := filepath.Join(isolate(t), "sandboxd.db")
	s := openTest(t, path, nil)
	must(t, s.Insert(&Session{ID: "good", Identity: ident("main")}))
	_ = s.Close()
	setRaw(t, path, bucketSessions, []byte("bad"), []byte("{not json"))
	s = openTest(t, path, nil)
	if _, err := s.List(); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), `"bad"`) {
		t.Fatalf("List: err = %v, want ErrCorrupt naming the record", err)
	}
	if _, err := s.Get("good"); err != nil {
		t.Fatalf("Get of an intact record: %v", err)
	}
}

func TestNewerSchemaIsRefusedAndLeftUntouched(t *testing.T) {
	path := filepath.Join(isolate(t), "sandboxd.db")
	s := openTest(t, path, nil)
	_ = s.Close()
	setRaw(t, path, bucketMeta, keySchemaVersion, []byte("7"))
	before, _ := os.ReadFile(path)

	_, err := Open(context.Background(), path, Options{})
	if !errors.Is(err, ErrNewerSchema) {
		t.Fatalf("err = %v, want ErrNewerSchema", err)
	}
	var ne *NewerSchemaError
	if !errors.As(err, &ne) || ne.Version != 7 || ne.Supported != CurrentSchemaVersion {
		t.Fatalf("err = %#v", err)
	}
	if msg := err.Error(); !strings.Contains(msg, path) || !strings.Contains(msg, "version 7") || !strings.Contains(msg, fmt.Sprintf("version %d", CurrentSchemaVersion)) {
		t.Fatalf("message %q should name the file and both versions", msg)
	}
	after, _ := os.ReadFile(path)
	if !bytes.Equal(before, after) {
		t.Fatal("the file was modified")
	}
}

func setRaw(t *testing.T, path string, bucket, key, val []byte) {
	t.Helper()
	db, err := bolt.Open(path, 0o600, nil)
	must(t, err)
	must(t, db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucket).Put(key, val) }))
	must(t, db.Close())
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

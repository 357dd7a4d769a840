package watch

import (
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

const (
	waitLimit  = 10 * time.Second
	testSettle = 20 * time.Millisecond
	// quiet is how long a test waits to be sure no further callback comes:
	// well past the settle time and several poll intervals.
	quiet = 150 * time.Millisecond
)

// isolate keeps the test away from the real user's state.
func isolate(t *testing.T) {
	t.Helper()
	home := t.TempDir()
	t.Setenv("HOME", home)
	t.Setenv("XDG_CONFIG_HOME", filepath.Join(home, ".config"))
	t.Setenv("XDG_STATE_HOME", filepath.Join(home, ".local", "state"))
	t.Setenv("XDG_DATA_HOME", filepath.Join(home, ".local", "share"))
	t.Setenv("XDG_CACHE_HOME", filepath.Join(home, ".cache"))
	t.Setenv("XDG_RUNTIME_DIR", filepath.Join(home, "run"))
}

func newWatcher(t *testing.T, opts Options) (*Watcher, *testutil.LockedBuffer) {
	t.Helper()
	isolate(t)
	logs := &testutil.LockedBuffer{}
	opts.Logger = slog.New(slog.NewTextHandler(logs, nil))
	if opts.Settle == 0 {
		opts.Settle = testSettle
	}
	if opts.PollInterval == 0 {
		opts.PollInterval = 20 * time.Millisecond
	}
	w, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	return w, logs
}

// counter is an onChange callback that signals each call.
type counter struct{ calls chan struct{} }

func newCounter() *counter { return &counter{calls: make(chan struct{}, 100)} }

func (c *counter) onChange() { c.calls <- struct{}{} }

func (c *counter) expectOne(t *testing.T) {
	t.Helper()
	select {
	case <-c.calls:
	case <-time.After(waitLimit):
		t.Fatal("timed out waiting for the change callback")
	}
	c.expectNone(t)
}

func (c *counter) expectNone(t *testing.T) {
	t.Helper()
	select {
	case <-c.calls:
		t.Fatal("unexpected extra change callback")
	case <-time.After(quiet):
	}
}

func write(t *testing.T, path, data string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

// atomicSave saves like editors and git do: write a temporary file in the
// same directory, chmod it, rename it over the target.
func atomicSave(t *testing.T, path, data string) {
	t.Helper()
	tmp := path + ".tmp~"
	write(t, tmp, data)
	if err := os.Chmod(tmp, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func TestContentChangeIsOneCallback(t *testing.T) {
	w, _ := newWatcher(t, Options{})
	dir := t.TempDir()
	file := filepath.Join(dir, "sandbox.yml")
	write(t, file, "a: 1\n")
	c := newCounter()
	cancel, err := w.WatchFile(file, c.onChange)
	if err != nil {
		t.Fatal(err)
	}
	defer cancel()

	// Unrelated files in the same directory are ignored.
	write(t, filepath.Join(dir, "other.yml"), "x")
	c.expectNone(t)

	// An in-place save in several writes (truncate, write, write, chmod).
	f, err := os.OpenFile(file, os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString("a: ")
	f.WriteString("2\n")
	f.Close()
	os.Chmod(file, 0o600)
	c.expectOne(t)
}

func TestIdenticalRewriteIsNoCallback(t *testing.T) {
	w, _ := newWatcher(t, Options{})
	file := filepath.Join(t.TempDir(), "sandbox.yml")
	write(t, file, "same\n")
	c := newCounter()
	cancel, err := w.WatchFile(file, c.onChange)
	if err != nil {
		t.Fatal(err)
	}
	defer cancel()
	write(t, file, "same\n")
	atomicSave(t, file, "same\n")
	os.Chmod(file, 0o600)
	c.expectNone(t)
}

func TestAtomicRenameSaveIsOneCallback(t *testing.T) {
	w, _ := newWatcher(t, Options{})
	file := filepath.Join(t.TempDir(), "sandbox.yml")
	write(t, file, "v1\n")
	c := newCounter()
	cancel, err := w.WatchFile(file, c.onChange)
	if err != nil {
		t.Fatal(err)
	}
	defer cancel()
	atomicSave(t, file, "v2\n")
	c.expectOne(t)
	// The watch survives the replaced inode: the next save is seen too.
	atomicSave(t, file, "v3\n")
	c.expectOne(t)
}

func TestFileAppearsAndDisappears(t *testing.T) {
	w, _ := newWatcher(t, Options{})
	file := filepath.Join(t.TempDir(), "sandbox.yml")
	c := newCounter()
	cancel, err := w.WatchFile(file, c.onChange) // does not exist yet
	if err != nil {
		t.Fatal(err)
	}
	defer cancel()
	write(t, file, "new\n")
	c.expectOne(t)
	if err := os.Remove(file); err != nil {
		t.Fatal(err)
	}
	c.expectOne(t)
}

func TestSharedWatchAndCancel(t *testing.T) {
	w, _ := newWatcher(t, Options{})
	dir := t.TempDir()
	file := filepath.Join(dir, "sandbox.yml")
	write(t, file, "v1\n")
	a, b := newCounter(), newCounter()
	cancelA, err := w.WatchFile(file, a.onChange)
	if err != nil {
		t.Fatal(err)
	}
	// A second spelling of the same path shares the watch.
	cancelB, err := w.WatchFile(filepath.Join(dir, ".", "sandbox.yml"), b.onChange)
	if err != nil {
		t.Fatal(err)
	}
	if files, _ := w.Watching(); files != 1 {
		t.Fatalf("watching %d files, want 1", files)
	}
	write(t, file, "v2\n")
	a.expectOne(t)
	b.expectOne(t)

	cancelA()
	cancelA() // idempotent
	write(t, file, "v3\n")
	b.expectOne(t)
	a.expectNone(t)

	cancelB()
	if files, _ := w.Watching(); files != 0 {
		t.Fatalf("watching %d files after the last cancel, want 0", files)
	}
	if list := w.fsw.WatchList(); len(list) != 0 {
		t.Fatalf("inotify still watches %v after the last cancel", list)
	}
	write(t, file, "v4\n")
	b.expectNone(t)
}

func TestPollingFallbackGivesRightAnswers(t *testing.T) {
	for _, tc := range []struct {
		name       string
		maxWatches int
		wantPolled int
	}{
		{"unlimited", 0, 0},
		{"limit 1", 1, 1},
		{"poll only", -1, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, logs := newWatcher(t, Options{MaxWatches: tc.maxWatches})
			fileA := filepath.Join(t.TempDir(), "a.yml")
			fileB := filepath.Join(t.TempDir(), "b.yml")
			write(t, fileA, "a1")
			write(t, fileB, "b1")
			a, b := newCounter(), newCounter()
			cancelA, err := w.WatchFile(fileA, a.onChange)
			if err != nil {
				t.Fatal(err)
			}
			defer cancelA()
			cancelB, err := w.WatchFile(fileB, b.onChange)
			if err != nil {
				t.Fatal(err)
			}
			defer cancelB()
			if _, polled := w.Watching(); polled != tc.wantPolled {
				t.Fatalf("%d files polled, want %d", polled, tc.wantPolled)
			}
			if tc.maxWatches > 0 && !strings.Contains(logs.String(), "file watch limit reached") {
				t.Fatalf("no warning logged when the watch limit was reached; logs:\n%s", logs)
			}

			atomicSave(t, fileB, "b2")
			b.expectOne(t)
			write(t, fileA, "a2")
			a.expectOne(t)
			write(t, fileB, "b2") // same content: nothing
			b.expectNone(t)
			if err := os.Remove(fileB); err != nil {
				t.Fatal(err)
			}
			b.expectOne(t)
		})
	}
}

func TestRemovedDirectoryFallsBackToPolling(t *testing.T) {
	w, logs := newWatcher(t, Options{})
	dir := filepath.Join(t.TempDir(), "repo")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "sandbox.yml")
	write(t, file, "v1")
	c := newCounter()
	cancel, err := w.WatchFile(file, c.onChange)
	if err != nil {
		t.Fatal(err)
	}
	defer cancel()
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	c.expectOne(t) // the file is gone
	// Recreated directory: inotify lost its watch, polling still sees it.
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	write(t, file, "v2")
	c.expectOne(t)
	if !strings.Contains(logs.String(), "polling its files") {
		t.Fatalf("no warning about the lost directory watch; logs:\n%s", logs)
	}
}

func TestWatchFileBadInput(t *testing.T) {
	w, _ := newWatcher(t, Options{})
	if _, err := w.WatchFile(filepath.Join(t.TempDir(), "x"), nil); err == nil {
		t.Fatal("nil callback accepted")
	}
	// A directory has no content to compare.
	dir := t.TempDir()
	if _, err := w.WatchFile(dir, func() {}); err == nil {
		t.Fatal("watching a directory succeeded")
	}
	if files, _ := w.Watching(); files != 0 {
		t.Fatalf("a failed WatchFile left %d watches", files)
	}
	if list := w.fsw.WatchList(); len(list) != 0 {
		t.Fatalf("a failed WatchFile left inotify watches %v", list)
	}
}

// A watched path that is (or becomes) a link to /dev/zero or a FIFO costs a
// bounded, non-blocking read: a repository can commit either.
func TestWatchingSpecialFilesNeverBlocks(t *testing.T) {
	w, _ := newWatcher(t, Options{})
	dir := t.TempDir()
	zero, fifo := filepath.Join(dir, "zero.yml"), filepath.Join(dir, "fifo.yml")
	if err := os.Symlink("/dev/zero", zero); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 2)
	for _, p := range []string{zero, fifo} {
		go func() {
			_, err := w.WatchFile(p, func() {})
			done <- err
		}()
	}
	for range 2 {
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(waitLimit):
			t.Fatal("watching /dev/zero or a FIFO blocked")
		}
	}
}

func TestCloseStopsEverything(t *testing.T) {
	isolate(t)
	before := runtime.NumGoroutine()
	w, err := New(Options{Settle: testSettle, PollInterval: 10 * time.Millisecond, MaxWatches: 1})
	if err != nil {
		t.Fatal(err)
	}
	fileA := filepath.Join(t.TempDir(), "a")
	fileB := filepath.Join(t.TempDir(), "b") // polled
	write(t, fileA, "1")
	write(t, fileB, "1")
	c := newCounter()
	cancelA, err := w.WatchFile(fileA, c.onChange)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.WatchFile(fileB, c.onChange); err != nil {
		t.Fatal(err)
	}
	write(t, fileA, "2") // a change pending in the settle timer while closing
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	// Drain what may have fired before Close returned; nothing may follow.
	for len(c.calls) > 0 {
		<-c.calls
	}
	write(t, fileA, "3")
	write(t, fileB, "3")
	c.expectNone(t)
	cancelA() // safe after Close
	if _, err := w.WatchFile(fileA, c.onChange); !errors.Is(err, ErrClosed) {
		t.Fatalf("WatchFile after Close: %v, want ErrClosed", err)
	}
	deadline := time.Now().Add(waitLimit)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before {
		t.Fatalf("%d goroutines after Close, %d before", n, before)
	}
}

func TestCallbackMayCancelAndWatch(t *testing.T) {
	w, _ := newWatcher(t, Options{})
	dir := t.TempDir()
	file, other := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	write(t, file, "1")
	done := make(chan error, 1)
	var cancel func()
	var mu sync.Mutex
	mu.Lock()
	cancel, err := w.WatchFile(file, func() {
		mu.Lock()
		defer mu.Unlock()
		cancel() // from inside the callback: must not deadlock
		_, err := w.WatchFile(other, func() {})
		done <- err
	})
	mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	write(t, file, "2")
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(waitLimit):
		t.Fatal("callback did not finish")
	}
	if files, _ := w.Watching(); files != 1 {
		t.Fatalf("watching %d files, want 1 (the one added by the callback)", files)
	}
}

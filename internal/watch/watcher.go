// Package watch tells the daemon when files it depends on change: session
// config files (drift), .git/HEAD (the cached branch) and sandboxd's own
// config. It uses fsnotify on parent directories, so atomic-rename saves are
// seen, compares content hashes so that only real content changes are
// reported, and falls back to polling a file when no inotify watch can be
// had, trading latency for never giving a wrong answer.
package watch

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
)

// Defaults of Options.
const (
	DefaultPollInterval = 2 * time.Second
	DefaultSettle       = 50 * time.Millisecond
	DefaultVanishedFor  = 10 * time.Minute
)

// ErrClosed is returned by WatchFile after Close.
var ErrClosed = errors.New("file watcher is closed")

// Options configure a Watcher. Zero values select the defaults.
type Options struct {
	Logger *slog.Logger
	// PollInterval is how often files without an fsnotify watch are
	// checked (default 2s).
	PollInterval time.Duration
	// MaxWatches caps the fsnotify (directory) watches this Watcher holds;
	// files beyond it are polled. 0 means no cap (the kernel's limit still
	// applies and is handled the same way); negative means poll everything.
	MaxWatches int
	// Settle is how long a file must stay quiet after an event before its
	// content is compared, so that an editor's burst of write, rename and
	// chmod is one change (default 50ms).
	Settle time.Duration
	// VanishedFor is how long the files of a directory that no longer
	// exists (a deleted checkout) are polled; after it they are polled no
	// more until WatchFile asks for one of them again (default 10m).
	VanishedFor time.Duration
	Now         func() time.Time
}

// Watcher watches files for content changes. Callbacks run on one
// goroutine, one at a time, never while the Watcher holds a lock: they may
// call WatchFile and cancel functions, but not Close.
type Watcher struct {
	log          *slog.Logger
	pollInterval time.Duration
	settle       time.Duration
	vanishedFor  time.Duration
	maxWatches   int
	now          func() time.Time
	fsw          *fsnotify.Watcher // nil when inotify is unavailable

	mu        sync.Mutex
	files     map[string]*fileWatch // by resolved path
	dirs      map[string]*dirWatch  // by resolved directory
	fsWatches int                   // directories with an fsnotify watch
	pending   map[string]check      // files the dispatcher must compare
	nextID    uint64
	closed    bool

	wake chan struct{} // capacity 1: pending is non-empty
	done chan struct{} // closed by Close
	wg   sync.WaitGroup
}

type fileWatch struct {
	path  string
	dir   string
	users []fileUser
	// state is the content last seen; only the dispatcher updates it after
	// creation.
	state content
	// timer fires the comparison once the file has settled; burstStart
	// bounds how long a continuous burst may postpone it.
	timer      *time.Timer
	burstStart time.Time
}

type fileUser struct {
	id       uint64
	onChange func()
}

type dirWatch struct {
	files  int
	polled bool // no fsnotify watch: its files are polled
	// goneSince is when a poll first found the directory missing (zero
	// while it exists); abandoned is set once it stayed missing for
	// VanishedFor: its files are not polled any more.
	goneSince time.Time
	abandoned bool
}

// content identifies a file's content: absent, or present with a hash.
type content struct {
	exists bool
	sum    [sha256.Size]byte
}

// New starts a Watcher. If inotify cannot be initialized (for example the
// per-user instance limit is reached), every file is polled and a warning is
// logged.
func New(opts Options) (*Watcher, error) {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.PollInterval <= 0 {
		opts.PollInterval = DefaultPollInterval
	}
	if opts.Settle <= 0 {
		opts.Settle = DefaultSettle
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.VanishedFor <= 0 {
		opts.VanishedFor = DefaultVanishedFor
	}
	w := &Watcher{
		log:          opts.Logger,
		pollInterval: opts.PollInterval,
		settle:       opts.Settle,
		vanishedFor:  opts.VanishedFor,
		maxWatches:   opts.MaxWatches,
		now:          opts.Now,
		files:        make(map[string]*fileWatch),
		dirs:         make(map[string]*dirWatch),
		pending:      make(map[string]check),
		wake:         make(chan struct{}, 1),
		done:         make(chan struct{}),
	}
	if opts.MaxWatches >= 0 {
		fsw, err := fsnotify.NewWatcher()
		if err != nil {
			w.log.Warn("file watching unavailable, polling instead; raise fs.inotify.max_user_instances to fix", "interval", w.pollInterval, "err", err)
		} else {
			w.fsw = fsw
			w.wg.Add(1)
			go w.readEvents()
		}
	}
	w.wg.Add(2)
	go w.dispatch()
	go w.poll()
	return w, nil
}

// Close stops watching: no callback runs after Close returns. Cancel
// functions stay safe to call.
func (w *Watcher) Close() error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return nil
	}
	w.closed = true
	for _, f := range w.files {
		if f.timer != nil {
			f.timer.Stop()
		}
	}
	w.mu.Unlock()
	close(w.done)
	var err error
	if w.fsw != nil {
		if cerr := w.fsw.Close(); cerr != nil {
			err = fmt.Errorf("close inotify watcher: %w", cerr)
		}
	}
	w.wg.Wait()
	return err
}

// WatchFile calls onChange whenever the content of path changes (including
// the file appearing or disappearing). A save that leaves the content
// identical calls nothing; a burst of events within the settle time is one
// change. The parent directory is watched, so saves that replace the file by
// renaming are seen. The returned cancel removes this callback; the watch
// itself goes when its last user cancels.
func (w *Watcher) WatchFile(path string, onChange func()) (cancel func(), err error) {
	if onChange == nil {
		return nil, errors.New("watch file: onChange is nil")
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("watch file %s: %w", path, err)
	}
	dir, name := filepath.Split(abs)
	dir = filepath.Clean(dir)
	// inotify reports events under the path a directory was added with;
	// resolve symlinks so that two spellings share one watch and one name.
	if real, err := filepath.EvalSymlinks(dir); err == nil {
		dir = real
	}
	abs = filepath.Join(dir, name)

	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, fmt.Errorf("watch file %s: %w", abs, ErrClosed)
	}
	f := w.files[abs]
	if f == nil {
		d := w.dirs[dir]
		if d == nil {
			d = &dirWatch{polled: !w.addDirLocked(dir, abs)}
			w.dirs[dir] = d
		}
		// The baseline is read after the directory watch exists, so a change
		// racing with WatchFile is either in the baseline or reported.
		state, err := readContent(abs)
		if err != nil {
			w.releaseDirLocked(dir, d)
			return nil, fmt.Errorf("watch file %s: %w", abs, err)
		}
		d.files++
		f = &fileWatch{path: abs, dir: dir, state: state}
		w.files[abs] = f
	}
	if d := w.dirs[dir]; d.abandoned {
		// Asked for again (the checkout may be back): poll it anew, for
		// VanishedFor at most if it is still missing.
		d.abandoned, d.goneSince = false, time.Time{}
	}
	w.nextID++
	id := w.nextID
	f.users = append(f.users, fileUser{id: id, onChange: onChange})
	var once sync.Once
	return func() { once.Do(func() { w.unwatch(f, id) }) }, nil
}

// addDirLocked adds an fsnotify watch on dir and reports whether it did;
// when it cannot, the directory's files are polled.
func (w *Watcher) addDirLocked(dir, file string) bool {
	switch {
	case w.fsw == nil:
		return false
	case w.maxWatches > 0 && w.fsWatches >= w.maxWatches:
		w.log.Warn("file watch limit reached, polling instead", "file", file, "limit", w.maxWatches, "interval", w.pollInterval)
		return false
	}
	if err := w.fsw.Add(dir); err != nil {
		if errors.Is(err, syscall.ENOSPC) {
			w.log.Warn("inotify watch limit reached, polling instead; raise fs.inotify.max_user_watches to fix", "file", file, "interval", w.pollInterval)
		} else {
			w.log.Warn("cannot watch directory, polling instead", "dir", dir, "file", file, "interval", w.pollInterval, "err", err)
		}
		return false
	}
	w.fsWatches++
	return true
}

func (w *Watcher) releaseDirLocked(dir string, d *dirWatch) {
	if d.files > 0 {
		return
	}
	delete(w.dirs, dir)
	if !d.polled {
		w.fsWatches--
		// The directory may be gone already, taking its watch with it.
		_ = w.fsw.Remove(dir)
	}
}

func (w *Watcher) unwatch(f *fileWatch, id uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.files[f.path] != f {
		return
	}
	for i, u := range f.users {
		if u.id == id {
			f.users = append(f.users[:i:i], f.users[i+1:]...)
			break
		}
	}
	if len(f.users) > 0 {
		return
	}
	delete(w.files, f.path)
	delete(w.pending, f.path)
	if f.timer != nil {
		f.timer.Stop()
	}
	if w.closed {
		return
	}
	d := w.dirs[f.dir]
	d.files--
	w.releaseDirLocked(f.dir, d)
}

// Watching reports how many files are watched and how many of them are
// polled, for status output and tests.
func (w *Watcher) Watching() (files, polled int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, f := range w.files {
		if d := w.dirs[f.dir]; d.polled && !d.abandoned {
			polled++
		}
	}
	return len(w.files), polled
}

func (w *Watcher) readEvents() {
	defer w.wg.Done()
	for {
		select {
		case ev, ok := <-w.fsw.Events:
			if !ok {
				return
			}
			w.handleEvent(ev)
		case err, ok := <-w.fsw.Errors:
			if !ok {
				return
			}
			w.handleError(err)
		}
	}
}

func (w *Watcher) handleEvent(ev fsnotify.Event) {
	name := filepath.Clean(ev.Name)
	w.mu.Lock()
	defer w.mu.Unlock()
	if f := w.files[name]; f != nil {
		w.settleLocked(f)
		return
	}
	if d := w.dirs[name]; d != nil && !d.polled && ev.Has(fsnotify.Remove|fsnotify.Rename) {
		// The directory itself went away, and its inotify watch with it:
		// poll its files from now on so a recreated file is still seen.
		w.log.Warn("watched directory removed or renamed, polling its files", "dir", name, "interval", w.pollInterval)
		d.polled = true
		w.fsWatches--
		for _, f := range w.files {
			if f.dir == name {
				w.settleLocked(f)
			}
		}
	}
}

func (w *Watcher) handleError(err error) {
	if errors.Is(err, fsnotify.ErrEventOverflow) {
		// Events were dropped: compare every watched file.
		w.log.Warn("inotify event queue overflowed, rechecking every watched file")
		w.mu.Lock()
		for path := range w.files {
			w.enqueueLocked(path, checkSettled)
		}
		w.mu.Unlock()
		return
	}
	w.log.Warn("file watching error", "err", err)
}

// settleLocked schedules a comparison of f once events stop for the settle
// time, but no later than 10 settle times after the burst began.
func (w *Watcher) settleLocked(f *fileWatch) {
	if w.closed {
		return
	}
	if f.timer == nil {
		f.burstStart = w.now()
		f.timer = time.AfterFunc(w.settle, func() {
			w.mu.Lock()
			defer w.mu.Unlock()
			if w.files[f.path] == f {
				f.timer = nil
				w.enqueueLocked(f.path, checkSettled)
			}
		})
		return
	}
	if w.now().Sub(f.burstStart) < 10*w.settle {
		// A fired timer re-armed here only causes one extra comparison.
		f.timer.Reset(w.settle)
	}
}

// check is what the dispatcher does with a pending file.
type check int

const (
	// checkPolled: a poll tick. A difference may be a save in progress,
	// so it only starts the settle timer, like an fsnotify event.
	checkPolled check = iota + 1
	// checkSettled: the file has been quiet for the settle time; a
	// difference is a change.
	checkSettled
)

func (w *Watcher) enqueueLocked(path string, c check) {
	w.pending[path] = max(w.pending[path], c)
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

func (w *Watcher) poll() {
	defer w.wg.Done()
	t := time.NewTicker(w.pollInterval)
	defer t.Stop()
	for {
		select {
		case <-w.done:
			return
		case <-t.C:
		}
		gone := w.missingPolledDirs()
		w.mu.Lock()
		now := w.now()
		for dir, d := range w.dirs {
			if !d.polled || d.abandoned {
				continue
			}
			switch {
			case !gone[dir]:
				d.goneSince = time.Time{}
			case d.goneSince.IsZero():
				d.goneSince = now
			case now.Sub(d.goneSince) >= w.vanishedFor:
				d.abandoned = true
				w.log.Warn("watched directory gone for long, no longer polling its files", "dir", dir, "gone_for", now.Sub(d.goneSince).Round(time.Second))
			}
		}
		for path, f := range w.files {
			if d := w.dirs[f.dir]; d.polled && !d.abandoned && f.timer == nil {
				w.enqueueLocked(path, checkPolled)
			}
		}
		w.mu.Unlock()
	}
}

// missingPolledDirs reports which polled directories do not exist; the
// stats run without the lock.
func (w *Watcher) missingPolledDirs() map[string]bool {
	w.mu.Lock()
	var dirs []string
	for dir, d := range w.dirs {
		if d.polled && !d.abandoned {
			dirs = append(dirs, dir)
		}
	}
	w.mu.Unlock()
	gone := map[string]bool{}
	for _, dir := range dirs {
		if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
			gone[dir] = true
		}
	}
	return gone
}

// dispatch compares pending files with their last content and runs the
// callbacks of those that changed, one at a time.
func (w *Watcher) dispatch() {
	defer w.wg.Done()
	for {
		select {
		case <-w.done:
			return
		case <-w.wake:
		}
		w.mu.Lock()
		pending := w.pending
		w.pending = make(map[string]check)
		w.mu.Unlock()
		for p, c := range pending {
			w.compare(p, c)
		}
	}
}

func (w *Watcher) compare(path string, c check) {
	w.mu.Lock()
	f := w.files[path]
	w.mu.Unlock()
	if f == nil {
		return
	}
	state, err := readContent(path)
	if err != nil {
		// Unknown content is not a change; the next event or poll retries.
		w.log.Warn("read watched file", "file", path, "err", err)
		return
	}
	w.mu.Lock()
	if w.closed || w.files[path] != f || state == f.state {
		w.mu.Unlock()
		return
	}
	if c == checkPolled {
		w.settleLocked(f)
		w.mu.Unlock()
		return
	}
	f.state = state
	users := append([]fileUser(nil), f.users...)
	w.mu.Unlock()
	for _, u := range users {
		select {
		case <-w.done:
			return
		default:
		}
		u.onChange()
	}
}

// maxHashed bounds what is read of a watched file. The files watched are
// small (HEAD, configs); past the bound the size and modification time stand
// in for the rest, so a file swapped for a huge one, or a link to /dev/zero,
// costs a bounded read.
const maxHashed = 1 << 20

func readContent(path string) (content, error) {
	// O_NONBLOCK: a FIFO must not block the watcher waiting for a writer.
	file, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return content{}, nil
	}
	if err != nil {
		return content{}, fmt.Errorf("read %s: %w", path, err)
	}
	defer file.Close()
	st, err := file.Stat()
	if err != nil {
		return content{}, fmt.Errorf("read %s: %w", path, err)
	}
	if st.IsDir() {
		return content{}, fmt.Errorf("%s is a directory, not a file", path)
	}
	h := sha256.New()
	// Only regular files are read; anything else is identified by its type.
	fmt.Fprintf(h, "%v\x00", st.Mode().Type())
	if st.Mode().IsRegular() {
		if _, err := io.Copy(h, io.LimitReader(file, maxHashed)); err != nil {
			return content{}, fmt.Errorf("read %s: %w", path, err)
		}
		if st.Size() > maxHashed {
			fmt.Fprintf(h, "\x00%d\x00%d", st.Size(), st.ModTime().UnixNano())
		}
	}
	c := content{exists: true}
	h.Sum(c.sum[:0])
	return c, nil
}

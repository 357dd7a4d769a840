// Package clifile is the RWX CLI's on-disk record of its sandboxes,
// .rwx/sandboxes/sandboxes.json, as that CLI reads and writes it: keys
// "branch:/absolute/config.yml" (version 1; version 0 files held
// "cwd:branch:config" keys, which the CLI migrates when it loads them), one
// record per key, written with a two-space indent through a temporary file
// renamed over the old one, under an exclusive flock(2) of
// sandboxes.json.lock that every CLI process takes while it resolves or
// creates a sandbox. sandboxd shares the file with the CLI so that each tool
// finds the sandbox the other started for the same checkout, branch and
// config.
package clifile

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"
)

// Version is the file format version this package writes, the RWX CLI's
// current one (branch:config keys with absolute config paths).
const Version = 1

// RelPath is where the file lives relative to the directory holding .rwx
// (the repository root).
const RelPath = ".rwx/sandboxes/sandboxes.json"

// ErrMalformed is returned (wrapped) for a file that is not the CLI's JSON.
var ErrMalformed = errors.New("malformed RWX CLI sandboxes file")

// Path is the file of the checkout at repoRoot.
func Path(repoRoot string) string {
	return filepath.Join(repoRoot, filepath.FromSlash(RelPath))
}

// Entry is one record, with the CLI's field names and order.
type Entry struct {
	RunID         string     `json:"runId"`
	ConfigFile    string     `json:"configFile"`
	ScopedToken   string     `json:"scopedToken,omitempty"`
	RunURL        string     `json:"runUrl,omitempty"`
	ConfigHash    string     `json:"configHash,omitempty"`
	CreatedAt     *time.Time `json:"createdAt,omitempty"`
	LastExecAt    *time.Time `json:"lastExecAt,omitempty"`
	ExecCount     int        `json:"execCount,omitempty"`
	ResetNagShown bool       `json:"resetNagShown,omitempty"`
}

// Key is the CLI's key of a session: "branch:configFile", the branch being
// "detached" when empty. configFile must be absolute (or empty): the CLI
// panics on any other key it builds, so none is ever written.
func Key(branch, configFile string) (string, error) {
	if configFile != "" && !filepath.IsAbs(configFile) {
		return "", fmt.Errorf("RWX CLI session key: config file %q is not absolute", configFile)
	}
	if branch == "" {
		branch = "detached"
	}
	return branch + ":" + configFile, nil
}

// ParseKey splits a version-1 key as the CLI does: at the first ":/"
// (absolute config paths; git branch names cannot hold ':'), else at the
// last ':'.
func ParseKey(key string) (branch, configFile string) {
	if i := strings.Index(key, ":/"); i >= 0 {
		return key[:i], key[i+1:]
	}
	if i := strings.LastIndex(key, ":"); i >= 0 {
		return key[:i], key[i+1:]
	}
	return key, ""
}

// ParseOldKey recognizes a version-0 key, "cwd:branch:config", the way the
// CLI does: an absolute cwd and a YAML config; a relative config is
// resolved against the cwd.
func ParseOldKey(key string) (cwd, branch, configFile string, ok bool) {
	last := strings.LastIndex(key, ":")
	if last < 0 {
		return "", "", "", false
	}
	cfg, rest := key[last+1:], key[:last]
	second := strings.LastIndex(rest, ":")
	if second < 0 {
		return "", "", "", false
	}
	cwd, branch = rest[:second], rest[second+1:]
	if !strings.HasPrefix(cwd, "/") || !(strings.HasSuffix(cfg, ".yml") || strings.HasSuffix(cfg, ".yaml")) {
		return "", "", "", false
	}
	if !filepath.IsAbs(cfg) {
		cfg = filepath.Join(cwd, cfg)
	}
	return cwd, branch, cfg, true
}

// File is the content of one sandboxes.json. Records are kept as written
// (unknown fields included) unless Set replaces them, so rewriting the file
// never loses what a newer CLI recorded.
type File struct {
	entries map[string]json.RawMessage
}

// onDisk is the file's top level, in the CLI's field order.
type onDisk struct {
	Version   int                        `json:"version,omitempty"`
	Sandboxes map[string]json.RawMessage `json:"sandboxes"`
}

// Parse parses the content of the file at path (named in errors); nil data
// is an empty file. A version-0 file comes back with its keys migrated, as
// the CLI migrates them. The caller reads the file (within its limits on
// repository files).
func Parse(path string, data []byte) (*File, error) {
	if data == nil {
		return &File{entries: map[string]json.RawMessage{}}, nil
	}
	var d onDisk
	if err := json.Unmarshal(data, &d); err != nil {
		return nil, fmt.Errorf("%w: %s: %v; fix or remove it (the RWX CLI cannot read it either)", ErrMalformed, path, err)
	}
	f := &File{entries: make(map[string]json.RawMessage, len(d.Sandboxes))}
	for key, raw := range d.Sandboxes {
		if d.Version < Version {
			if _, branch, cfg, ok := ParseOldKey(key); ok {
				if k, err := Key(branch, cfg); err == nil {
					key = k
				}
			}
		}
		f.entries[key] = raw
	}
	return f, nil
}

// Keys returns the keys, sorted.
func (f *File) Keys() []string {
	keys := make([]string, 0, len(f.entries))
	for k := range f.entries {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// Get decodes the record of key. ok is false when there is none; a record
// that does not decode is an error.
func (f *File) Get(key string) (e Entry, ok bool, err error) {
	raw, ok := f.entries[key]
	if !ok {
		return e, false, nil
	}
	if err := json.Unmarshal(raw, &e); err != nil {
		return e, true, fmt.Errorf("%w: record %q: %v", ErrMalformed, key, err)
	}
	return e, true, nil
}

// Set replaces the record of key.
func (f *File) Set(key string, e Entry) {
	raw, _ := json.Marshal(e) // strings, ints, bools and times always marshal
	f.entries[key] = raw
}

// Delete removes the record of key.
func (f *File) Delete(key string) {
	delete(f.entries, key)
}

// Marshal is the file's content exactly as the CLI writes it.
func (f *File) Marshal() ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetIndent("", "  ")
	if err := enc.Encode(onDisk{Version: Version, Sandboxes: f.entries}); err != nil {
		return nil, fmt.Errorf("encode the RWX CLI's sandboxes file: %w", err)
	}
	return b.Bytes(), nil
}

// Write replaces the file of the checkout at repoRoot atomically
// (temporary file in the same directory, fsync, rename), creating its
// directory with the CLI's .gitignore. The caller holds the lock (Lock).
// Everything happens inside the repository: a symlink leading out of it
// is refused.
func (f *File) Write(repoRoot string) error {
	data, err := f.Marshal()
	if err != nil {
		return err
	}
	root, err := openDir(repoRoot)
	if err != nil {
		return err
	}
	defer root.Close()
	rel := filepath.FromSlash(RelPath)
	tmp := filepath.Join(filepath.Dir(rel), ".sandboxes-"+randomSuffix()+".json.tmp")
	out, err := root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("write the RWX CLI's sandboxes file in %s: %w", repoRoot, err)
	}
	defer root.Remove(tmp)
	if _, err := out.Write(data); err != nil {
		out.Close()
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	if err := out.Sync(); err != nil {
		out.Close()
		return fmt.Errorf("sync %s: %w", tmp, err)
	}
	if err := out.Close(); err != nil {
		return fmt.Errorf("close %s: %w", tmp, err)
	}
	if err := root.Rename(tmp, rel); err != nil {
		return fmt.Errorf("replace %s: %w", Path(repoRoot), err)
	}
	if d, err := root.Open(filepath.Dir(rel)); err == nil {
		_ = d.Sync() // the rename survives a crash; best effort, the file only caches what the remote knows
		d.Close()
	}
	return nil
}

// openDir opens the checkout at repoRoot as an os.Root (no path or symlink
// may leave it) with the sandboxes directory created, and, as the CLI does,
// a .gitignore ignoring everything in it, so nothing there is committed or
// synced.
func openDir(repoRoot string) (*os.Root, error) {
	root, err := os.OpenRoot(repoRoot)
	if err != nil {
		return nil, fmt.Errorf("open the checkout %s: %w", repoRoot, err)
	}
	dir := filepath.Dir(filepath.FromSlash(RelPath))
	if err := root.MkdirAll(dir, os.ModePerm); err != nil {
		root.Close()
		return nil, fmt.Errorf("create %s in %s: %w", dir, repoRoot, err)
	}
	if ig, err := root.OpenFile(filepath.Join(dir, ".gitignore"), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644); err == nil {
		_, _ = ig.Write([]byte("*\n")) // the CLI ignores this failure too
		ig.Close()
	}
	return root, nil
}

func randomSuffix() string {
	var b [6]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return hex.EncodeToString(b[:])
}

// lockPoll is how often Lock retries while another process holds the lock.
const lockPoll = 20 * time.Millisecond

// Lock takes the CLI's exclusive lock of the file of the checkout at
// repoRoot (flock(2) on sandboxes.json.lock, the file the CLI locks),
// waiting while another process holds it until ctx ends. Call unlock when
// done. The lock file must be a regular file inside the repository (it is
// opened non-blocking, so a FIFO planted there cannot hang the daemon).
func Lock(ctx context.Context, repoRoot string) (unlock func(), err error) {
	root, err := openDir(repoRoot)
	if err != nil {
		return nil, err
	}
	defer root.Close()
	rel := filepath.FromSlash(RelPath) + ".lock"
	lf, err := root.OpenFile(rel, os.O_CREATE|os.O_RDONLY|syscall.O_NONBLOCK, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open the RWX CLI's lock in %s: %w", repoRoot, err)
	}
	if st, err := lf.Stat(); err != nil || !st.Mode().IsRegular() {
		lf.Close()
		return nil, fmt.Errorf("the RWX CLI's lock %s is not a regular file: remove it", Path(repoRoot)+".lock")
	}
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		err := syscall.Flock(int(lf.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() {
				_ = syscall.Flock(int(lf.Fd()), syscall.LOCK_UN)
				lf.Close()
			}, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) && !errors.Is(err, syscall.EINTR) {
			lf.Close()
			return nil, fmt.Errorf("lock %s: %w", Path(repoRoot)+".lock", err)
		}
		t.Reset(lockPoll)
		select {
		case <-ctx.Done():
			lf.Close()
			return nil, fmt.Errorf("lock %s: held by another process (an RWX CLI command?): %w", Path(repoRoot)+".lock", ctx.Err())
		case <-t.C:
		}
	}
}

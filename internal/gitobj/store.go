package gitobj

import (
	"bufio"
	"bytes"
	"compress/zlib"
	"container/list"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/adler32"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// ErrNotFound is returned (wrapped) when an object is not in the repository.
var ErrNotFound = errors.New("object not found")

const (
	// maxObjectSize bounds what Read will load into memory.
	maxObjectSize = 1 << 30
	// defaultTreeCacheSize bounds the parsed-tree cache; trees are immutable,
	// so caching never goes stale, only memory needs bounding.
	defaultTreeCacheSize = 4096
)

// Store is one repository's object database. Reads go through one
// long-lived `git cat-file --batch` child, started on first use and
// restarted on the next call if it died; writes are loose objects written
// directly. A Store is safe for concurrent use.
type Store struct {
	gitDir string
	objDir string
	// command is the reader's argv; a field so tests can substitute a child
	// that misbehaves.
	command []string

	// sem serialises use of the child (its pipes carry one request at a
	// time); a channel rather than a mutex so waiting honours ctx.
	sem chan struct{}

	mu     sync.Mutex // guards child and closed
	child  *catFile
	closed bool

	cacheMu   sync.Mutex // guards the tree cache
	cacheMax  int
	cacheList *list.List // of *cacheItem, most recently used first
	cacheMap  map[OID]*list.Element

	// zw keeps zlib writers for reuse: each new one allocates its window
	// and tables, a good part of a small object's write.
	zw sync.Pool

	// treeReads counts readTree calls, so tests can check that edits only
	// read the trees along the changed paths.
	treeReads atomic.Int64
}

type cacheItem struct {
	oid     OID
	entries []Entry
}

// OpenStore opens the object database of the repository whose .git
// directory is gitDir. No process is started until the first read.
func OpenStore(gitDir string) (*Store, error) {
	abs, err := filepath.Abs(gitDir)
	if err != nil {
		return nil, fmt.Errorf("gitobj: open store %q: %w", gitDir, err)
	}
	objDir := filepath.Join(abs, "objects")
	fi, err := os.Stat(objDir)
	if err != nil {
		return nil, fmt.Errorf("gitobj: open store %q: %w", gitDir, err)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("gitobj: open store %q: %s is not a directory", gitDir, objDir)
	}
	return &Store{
		gitDir:    abs,
		objDir:    objDir,
		command:   []string{"git", "-c", "safe.directory=*", "cat-file", "--batch"},
		sem:       make(chan struct{}, 1),
		cacheMax:  defaultTreeCacheSize,
		cacheList: list.New(),
		cacheMap:  make(map[OID]*list.Element),
	}, nil
}

// Close stops the reader child. Later reads fail; writes still work since
// they need no process.
func (s *Store) Close() error {
	s.mu.Lock()
	c := s.child
	s.child = nil
	s.closed = true
	s.mu.Unlock()
	if c != nil {
		c.kill()
		<-c.done
	}
	return nil
}

// Read returns the kind ("blob", "tree", "commit", "tag") and content of an
// object. A missing object gives an error wrapping ErrNotFound.
func (s *Store) Read(ctx context.Context, oid OID) (kind string, data []byte, err error) {
	kind, data, err = s.read(ctx, oid)
	if err != nil {
		return "", nil, fmt.Errorf("gitobj: read %s: %w", oid, err)
	}
	return kind, data, nil
}

// read is Read with errors that do not repeat the object id.
func (s *Store) read(ctx context.Context, oid OID) (kind string, data []byte, err error) {
	if err := ctx.Err(); err != nil {
		return "", nil, err
	}
	select {
	case s.sem <- struct{}{}:
	case <-ctx.Done():
		return "", nil, ctx.Err()
	}
	defer func() { <-s.sem }()

	for attempt := 0; ; attempt++ {
		c, fresh, err := s.getChild()
		if err != nil {
			return "", nil, err
		}
		kind, data, err := c.request(ctx, oid)
		if err == nil || errors.Is(err, ErrNotFound) {
			return kind, data, err
		}
		// The child is now in an unknown state: drop it so the next call
		// starts a clean one.
		s.dropChild(c)
		if ctx.Err() != nil {
			return "", nil, fmt.Errorf("%w (%w)", ctx.Err(), err)
		}
		// A child kept from an earlier call may have died in between (killed,
		// or the repository repacked under it); one retry with a fresh child
		// makes that invisible. A fresh child failing is a real error.
		if fresh || attempt > 0 || errors.Is(err, errTooLarge) {
			return "", nil, err
		}
	}
}

// getChild returns the running child, starting one if there is none or it
// has exited; fresh reports whether it was just started.
func (s *Store) getChild() (c *catFile, fresh bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, false, errors.New("store is closed")
	}
	if s.child != nil {
		select {
		case <-s.child.done:
			s.child = nil
		default:
			return s.child, false, nil
		}
	}
	c, err = startCatFile(s.command, s.gitDir)
	if err != nil {
		return nil, false, err
	}
	s.child = c
	return c, true, nil
}

// dropChild kills c and forgets it if it is still the current child.
func (s *Store) dropChild(c *catFile) {
	c.kill()
	<-c.done
	s.mu.Lock()
	if s.child == c {
		s.child = nil
	}
	s.mu.Unlock()
}

// ReadTree returns the entries of a tree object (the zero OID reads as the
// empty tree). The result is the caller's to modify.
func (s *Store) ReadTree(ctx context.Context, oid OID) ([]Entry, error) {
	entries, err := s.readTree(ctx, oid)
	if err != nil {
		return nil, err
	}
	return slices.Clone(entries), nil
}

// readTree is ReadTree without the defensive copy: the slice may be shared
// through the cache and must not be modified.
func (s *Store) readTree(ctx context.Context, oid OID) ([]Entry, error) {
	s.treeReads.Add(1)
	if oid.IsZero() || oid == emptyTreeOID {
		return nil, nil
	}
	s.cacheMu.Lock()
	if el, ok := s.cacheMap[oid]; ok {
		s.cacheList.MoveToFront(el)
		entries := el.Value.(*cacheItem).entries
		s.cacheMu.Unlock()
		return entries, nil
	}
	s.cacheMu.Unlock()

	kind, data, err := s.read(ctx, oid)
	if err != nil {
		return nil, fmt.Errorf("gitobj: read tree %s: %w", oid, err)
	}
	if kind != "tree" {
		return nil, fmt.Errorf("gitobj: read tree %s: object is a %s", oid, kind)
	}
	entries, err := ParseTree(data)
	if err != nil {
		return nil, fmt.Errorf("gitobj: read tree %s: %w", oid, err)
	}
	s.cachePut(oid, entries)
	return entries, nil
}

func (s *Store) cachePut(oid OID, entries []Entry) {
	s.cacheMu.Lock()
	defer s.cacheMu.Unlock()
	if el, ok := s.cacheMap[oid]; ok {
		s.cacheList.MoveToFront(el)
		return
	}
	s.cacheMap[oid] = s.cacheList.PushFront(&cacheItem{oid: oid, entries: entries})
	for s.cacheList.Len() > s.cacheMax {
		last := s.cacheList.Back()
		s.cacheList.Remove(last)
		delete(s.cacheMap, last.Value.(*cacheItem).oid)
	}
}

// Write stores data as a loose object of kind and returns its id. An object
// already present as a loose object is not rewritten. Tree content is
// validated, since a malformed tree would corrupt the repository.
func (s *Store) Write(kind string, data []byte) (OID, error) {
	switch kind {
	case "blob", "commit", "tag":
	case "tree":
		if _, err := ParseTree(data); err != nil {
			return OID{}, fmt.Errorf("gitobj: write tree: %w", err)
		}
	default:
		return OID{}, fmt.Errorf("gitobj: write object: unknown kind %q", kind)
	}
	return s.write(kind, data)
}

// write stores a loose object the way git does: zlib-compressed header and
// content, written to a temporary file in the objects directory (so the
// rename cannot cross file systems) and renamed into place read-only, so
// readers never see a partial object.
func (s *Store) write(kind string, data []byte) (OID, error) {
	oid := HashObject(kind, data)
	hex := oid.String()
	dir := filepath.Join(s.objDir, hex[:2])
	final := filepath.Join(dir, hex[2:])
	if _, err := os.Lstat(final); err == nil {
		return oid, nil
	}
	fail := func(err error) (OID, error) {
		return OID{}, fmt.Errorf("gitobj: write %s %s: %w", kind, oid, err)
	}
	z, err := s.deflate(kind, data)
	if err != nil {
		return fail(err)
	}
	tmp, err := writeTemp(s.objDir, z)
	if err != nil {
		return fail(err)
	}
	err = os.Rename(tmp, final)
	if errors.Is(err, fs.ErrNotExist) {
		// The fan-out directory is made only when missing: one system
		// call fewer for every other object.
		if err = os.MkdirAll(dir, 0o777); err == nil {
			err = os.Rename(tmp, final)
		}
	}
	if err != nil {
		os.Remove(tmp)
		return fail(err)
	}
	return oid, nil
}

// storedMax bounds the objects written as stored (uncompressed) zlib
// blocks: for a source file's few kilobytes, building Huffman codes costs
// more than the bytes it saves (git reads either).
const storedMax = 16 << 10

// deflate is kind's header and data as a zlib stream: stored blocks for a
// small object, else compressed at level 1, git's default for loose
// objects (core.looseCompression).
func (s *Store) deflate(kind string, data []byte) ([]byte, error) {
	hdr := objectHeader(kind, len(data))
	if len(data) <= storedMax {
		return zlibStored(hdr, data), nil
	}
	var b bytes.Buffer
	b.Grow(len(data)/2 + 64)
	zw, _ := s.zw.Get().(*zlib.Writer)
	var err error
	if zw != nil {
		zw.Reset(&b)
	} else if zw, err = zlib.NewWriterLevel(&b, zlib.BestSpeed); err != nil {
		return nil, err
	}
	defer s.zw.Put(zw)
	if _, err := zw.Write(hdr); err != nil {
		return nil, err
	}
	if _, err := zw.Write(data); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// zlibStored is the zlib stream (RFC 1950) of hdr and data, at most
// storedMax and a header, in one stored deflate block (RFC 1951, 3.2.4).
func zlibStored(hdr, data []byte) []byte {
	n := len(hdr) + len(data)
	out := make([]byte, 0, n+11)
	out = append(out, 0x78, 0x01) // deflate, 32 KiB window, no dictionary, fastest
	out = append(out, 1, byte(n), byte(n>>8), ^byte(n), ^byte(n>>8))
	out = append(append(out, hdr...), data...)
	return binary.BigEndian.AppendUint32(out, adler32.Checksum(out[7:]))
}

// writeTemp writes b to a new read-only file in dir whose name starts as
// git's temporary objects do ("tmp_obj_", so `git gc` cleans up what a
// crash leaves) and returns its path. Plain system calls: an *os.File
// would try the poller first, five calls more.
func writeTemp(dir string, b []byte) (string, error) {
	for attempt := 0; ; attempt++ {
		name := filepath.Join(dir, "tmp_obj_"+strconv.FormatUint(rand.Uint64(), 36))
		fd, err := syscall.Open(name, syscall.O_WRONLY|syscall.O_CREAT|syscall.O_EXCL|syscall.O_CLOEXEC, 0o444)
		if err == syscall.EEXIST && attempt < 10 {
			continue
		}
		if err != nil {
			return "", &os.PathError{Op: "create", Path: name, Err: err}
		}
		for rest := b; len(rest) > 0 && err == nil; {
			var n int
			n, err = syscall.Write(fd, rest)
			if err == syscall.EINTR {
				err = nil
			}
			rest = rest[max(n, 0):]
		}
		if cerr := syscall.Close(fd); err == nil {
			err = cerr
		}
		if err != nil {
			os.Remove(name)
			return "", &os.PathError{Op: "write", Path: name, Err: err}
		}
		return name, nil
	}
}

// errTooLarge marks an object over maxObjectSize.
var errTooLarge = errors.New("object too large")

// catFile is one `git cat-file --batch` child.
type catFile struct {
	cmd    *exec.Cmd
	stdin  *os.File // our write end
	stdout *os.File // our read end
	r      *bufio.Reader
	stderr *tailBuffer
	done   chan struct{} // closed once the child has been waited for
	once   sync.Once
}

// startCatFile starts argv with GIT_DIR pointing at gitDir. The pipes are
// created here, not by exec, so that kill can close our ends: that unblocks a
// pending read even if some grandchild still holds the other end.
func startCatFile(argv []string, gitDir string) (*catFile, error) {
	inR, inW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", argv[0], err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		return nil, fmt.Errorf("start %s: %w", argv[0], err)
	}
	c := &catFile{
		stdin:  inW,
		stdout: outR,
		r:      bufio.NewReaderSize(outR, 64<<10),
		stderr: &tailBuffer{max: 4096},
		done:   make(chan struct{}),
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = gitEnv(gitDir)
	cmd.Dir = gitDir
	cmd.Stdin = inR
	cmd.Stdout = outW
	cmd.Stderr = c.stderr
	// Bounds Wait if a grandchild keeps stderr open after the child exits.
	cmd.WaitDelay = time.Second
	c.cmd = cmd
	err = cmd.Start()
	inR.Close()
	outW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		return nil, fmt.Errorf("start %s: %w", strings.Join(argv, " "), err)
	}
	go func() {
		cmd.Wait()
		close(c.done)
	}()
	return c, nil
}

// gitEnv is the parent's environment without the variables that would
// redirect git away from gitDir, plus GIT_DIR.
func gitEnv(gitDir string) []string {
	env := make([]string, 0, len(os.Environ())+2)
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch k {
		case "GIT_DIR", "GIT_INDEX_FILE", "GIT_WORK_TREE", "GIT_OBJECT_DIRECTORY",
			"GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NO_REPLACE_OBJECTS":
			continue
		}
		env = append(env, kv)
	}
	// Replace refs would make cat-file answer with another object's content
	// than the id asked for.
	return append(env, "GIT_DIR="+gitDir, "GIT_NO_REPLACE_OBJECTS=1")
}

// kill stops the child and closes our pipe ends; safe to call repeatedly and
// concurrently with a request, which then fails promptly.
func (c *catFile) kill() {
	c.once.Do(func() {
		c.cmd.Process.Kill()
		c.stdin.Close()
		c.stdout.Close()
	})
}

// request asks the child for one object. Any error other than ErrNotFound
// leaves the child unusable.
func (c *catFile) request(ctx context.Context, oid OID) (string, []byte, error) {
	// If ctx ends mid-request the child is killed, which unblocks the pipe
	// I/O below; the caller then discards this child.
	stop := context.AfterFunc(ctx, c.kill)
	defer stop()

	hex := oid.String()
	if _, err := io.WriteString(c.stdin, hex+"\n"); err != nil {
		return "", nil, c.ioError("send request", err)
	}
	line, err := c.r.ReadSlice('\n')
	if err != nil {
		return "", nil, c.ioError("read header", err)
	}
	fields := strings.Fields(string(line))
	if len(fields) == 0 || fields[0] != hex {
		return "", nil, fmt.Errorf("cat-file: unexpected header %q", line)
	}
	if len(fields) == 2 && fields[1] == "missing" {
		return "", nil, ErrNotFound
	}
	if len(fields) != 3 {
		return "", nil, fmt.Errorf("cat-file: unexpected header %q", line)
	}
	kind := fields[1]
	size, err := strconv.ParseInt(fields[2], 10, 64)
	if err != nil || size < 0 {
		return "", nil, fmt.Errorf("cat-file: bad size in header %q", line)
	}
	if size > maxObjectSize {
		// Skipping a huge body would cost as much as reading it; the caller
		// restarts the child instead.
		return "", nil, fmt.Errorf("%s of %d bytes: %w (limit %d)", kind, size, errTooLarge, maxObjectSize)
	}
	buf := make([]byte, size+1)
	if _, err := io.ReadFull(c.r, buf); err != nil {
		return "", nil, c.ioError("read content", err)
	}
	if buf[size] != '\n' {
		return "", nil, errors.New("cat-file: content not followed by newline")
	}
	return kind, buf[:size], nil
}

// ioError describes a failed exchange with the child, including what it
// said on stderr if it has exited.
func (c *catFile) ioError(what string, err error) error {
	select {
	case <-c.done:
		if msg := strings.TrimSpace(c.stderr.String()); msg != "" {
			return fmt.Errorf("cat-file: %s: %w (exited: %s; stderr: %s)", what, err, c.cmd.ProcessState, msg)
		}
		return fmt.Errorf("cat-file: %s: %w (exited: %s)", what, err, c.cmd.ProcessState)
	default:
		return fmt.Errorf("cat-file: %s: %w", what, err)
	}
}

// tailBuffer keeps the last max bytes written to it, so a chatty child
// cannot grow memory without bound.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if over := len(b.buf) - b.max; over > 0 {
		b.buf = bytes.Clone(b.buf[over:])
	}
	return len(p), nil
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}

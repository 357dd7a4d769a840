package daemon

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"
)

// MaxSocketPathLen is the longest Unix socket path the kernel accepts:
// sun_path holds 108 bytes on Linux (104 on the BSDs), the NUL included.
const MaxSocketPathLen = len(syscall.RawSockaddrUnix{}.Path) - 1

// SocketPathError reports a socket path the kernel cannot bind.
type SocketPathError struct {
	Path string
	Len  int
}

func (e *SocketPathError) Error() string {
	return fmt.Sprintf("socket path %s is %d bytes, longer than the %d bytes a Unix socket path may have; point SANDBOXD_SOCKET (or --socket) at a shorter path, for example /tmp/sandboxd-%d.sock",
		e.Path, e.Len, MaxSocketPathLen, os.Getuid())
}

// checkSocketPath fails before bind when path cannot be a socket address,
// so the user gets the reason rather than "invalid argument".
func checkSocketPath(path string) error {
	if len(path) > MaxSocketPathLen {
		return &SocketPathError{Path: path, Len: len(path)}
	}
	return nil
}

// listenOwn creates the daemon's own socket at path. It must only be
// called while the single-instance lock is held: a socket file found there
// is then left over from a daemon that died, unless something else answers
// on it. privateDir is the directory sandboxd owns (the layout's runtime
// directory): it is created 0700 and must be ours; a directory chosen
// through SANDBOXD_SOCKET is created 0700 if missing and otherwise left as
// the user made it.
func listenOwn(path, privateDir string, log *slog.Logger) (*net.UnixListener, error) {
	if err := checkSocketPath(path); err != nil {
		return nil, err
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create the socket directory %s: %w", dir, err)
	}
	if dir == filepath.Clean(privateDir) {
		if err := ensurePrivateDir(dir, os.Getuid()); err != nil {
			return nil, err
		}
	}
	if err := removeStaleSocket(path, log); err != nil {
		return nil, err
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	// The daemon removes its socket itself, after the server has stopped and
	// while it still holds the lock (see shutdown).
	ln.SetUnlinkOnClose(false)
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		os.Remove(path)
		return nil, fmt.Errorf("restrict the socket %s to its owner: %w", path, err)
	}
	return ln, nil
}

// ensurePrivateDir checks that dir is a real directory owned by this user
// and readable by nobody else, tightening its mode when it is ours. It
// matters most for the fallback under /tmp, where someone else could have
// created the directory first.
func ensurePrivateDir(dir string, uid int) error {
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("check the socket directory %s: %w", dir, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("socket directory %s is not a directory (%s); remove it and start sandboxd again", dir, fi.Mode().Type())
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) != uid {
		return fmt.Errorf("socket directory %s belongs to uid %d, not to you (uid %d); remove it or set SANDBOXD_SOCKET to a path of your own", dir, st.Uid, uid)
	}
	if fi.Mode().Perm() != 0o700 {
		if err := os.Chmod(dir, 0o700); err != nil {
			return fmt.Errorf("restrict the socket directory %s to its owner: %w", dir, err)
		}
	}
	return nil
}

// removeStaleSocket removes a socket file nobody answers on. A path that is
// not a socket, or a socket something answers on, is left alone with an
// error: it belongs to someone else.
func removeStaleSocket(path string, log *slog.Logger) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("check for an old socket at %s: %w", path, err)
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%s exists and is not a socket (%s); remove it or set SANDBOXD_SOCKET to another path", path, fi.Mode().Type())
	}
	if c, err := net.DialTimeout("unix", path, 200*time.Millisecond); err == nil {
		c.Close()
		return fmt.Errorf("socket %s is in use by another process although this sandboxd holds the database lock (a sandboxd with another state directory, or a systemd socket unit?); stop it or set SANDBOXD_SOCKET to another path", path)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove the stale socket %s: %w", path, err)
	}
	log.Info("removed a stale socket left by a daemon that did not stop cleanly", "socket", path)
	return nil
}

// unixListeners checks what systemd passed: sandboxd serves only Unix
// stream sockets (the peer-UID check needs them).
func unixListeners(lns []net.Listener) ([]net.Listener, error) {
	var out []net.Listener
	var bad error
	for i, ln := range lns {
		switch ln := ln.(type) {
		case *net.UnixListener:
			out = append(out, ln)
		case nil:
			bad = fmt.Errorf("systemd passed file descriptor %d, which is not a listening stream socket; use ListenStream= in sandboxd.socket", 3+i)
		default:
			bad = fmt.Errorf("systemd passed a %s socket (%s), but sandboxd only serves Unix sockets; use ListenStream=%%t/sandboxd/sandboxd.sock in sandboxd.socket", ln.Addr().Network(), ln.Addr())
		}
	}
	if bad != nil {
		for _, ln := range lns {
			if ln != nil {
				ln.Close()
			}
		}
		return nil, bad
	}
	if len(out) == 0 {
		return nil, errors.New("LISTEN_FDS is set for this process but systemd passed no socket; check sandboxd.socket")
	}
	return out, nil
}

// activityListener counts accepted connections so that idle exit notices
// short requests that start and end between two idle checks. Accept returns
// the connection unchanged (the socket API reads its peer credentials).
type activityListener struct {
	net.Listener
	accepted *atomic.Uint64
}

func (l activityListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.accepted.Add(1)
	}
	return c, err
}

package client

import (
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc/peercred"
)

// UntrustedError says what serves the socket is not this user's sandboxd: a
// directory or socket another user controls, or a peer running as another
// user. Nothing was sent to it.
type UntrustedError struct {
	Socket string
	Reason string
}

func (e *UntrustedError) Error() string {
	return fmt.Sprintf("refusing to talk to %s: %s. Nothing was sent; another local user may be impersonating sandboxd. Remove the path (or set SANDBOXD_SOCKET to a socket in a directory only you can write) and run nook again", e.Socket, e.Reason)
}

// Is makes an UntrustedError match errdefs.ErrUnauthorized.
func (e *UntrustedError) Is(target error) bool { return target == errdefs.ErrUnauthorized }

// verifyDaemon checks, after connecting and before sending a byte, that the
// socket belongs to this user's daemon: the socket's directory is this
// user's and nobody else may write in it (or it is a sticky directory owned
// by root, like /tmp, holding a socket of this user's), the socket file is
// this user's, and the process on the other end runs as this user (peer
// credentials from the kernel). Whoever created /tmp/sandboxd-$UID first
// otherwise receives the argv of every exec (passwords included) and may
// answer anything.
func verifyDaemon(conn net.Conn, socket string) error {
	uid := os.Getuid()
	untrusted := func(format string, a ...any) error {
		return &UntrustedError{Socket: socket, Reason: fmt.Sprintf(format, a...)}
	}
	dir := filepath.Dir(socket)
	di, err := os.Stat(dir)
	if err != nil {
		return errdefs.Unavailable(fmt.Errorf("check the socket directory %s: %w", dir, err))
	}
	downer, ok := ownerOf(di)
	if !ok {
		return untrusted("the owner of the socket directory %s cannot be read on this system", dir)
	}
	sticky := di.Mode()&fs.ModeSticky != 0
	switch {
	case downer == uid && di.Mode().Perm()&0o022 != 0:
		return untrusted("its directory %s is writable by other users (mode %04o); make it yours only (chmod 700 %s)", dir, di.Mode().Perm(), dir)
	case downer == uid:
	case downer == 0 && sticky:
		// /tmp and the like: others may create files there but not replace
		// ours, so the socket file's owner decides.
	default:
		return untrusted("its directory %s belongs to %s, not to you (%s)", dir, describeUID(downer), describeUID(uid))
	}
	si, err := os.Lstat(socket)
	if err != nil {
		return errdefs.Unavailable(fmt.Errorf("check the socket %s: %w", socket, err))
	}
	if sowner, ok := ownerOf(si); !ok || sowner != uid {
		return untrusted("the socket belongs to %s, not to you (%s)", describeUID(sowner), describeUID(uid))
	}
	peer, _, _, err := peercred.Read(conn)
	if err != nil {
		return errdefs.Unavailable(fmt.Errorf("read the credentials of the process serving %s: %w", socket, err))
	}
	if peer != uid {
		return untrusted("the process serving it runs as %s, not as you (%s)", describeUID(peer), describeUID(uid))
	}
	return nil
}

func ownerOf(fi fs.FileInfo) (int, bool) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return -1, false
	}
	return int(st.Uid), true
}

// describeUID names a user for a message: "alice (uid 1000)".
func describeUID(uid int) string {
	if u, err := user.LookupId(strconv.Itoa(uid)); err == nil && u.Username != "" {
		return fmt.Sprintf("%s (uid %d)", u.Username, uid)
	}
	return "uid " + strconv.Itoa(uid)
}

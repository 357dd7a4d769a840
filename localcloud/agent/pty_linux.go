package agent

import (
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// openPTY allocates a pseudo-terminal pair through /dev/ptmx under root
// ("" for this machine's; a sandbox's root, so that the terminal belongs
// to the sandbox's own /dev/pts and is named there).
func openPTY(root string) (master, tty *os.File, err error) {
	m, err := openInRoot(root, "dev/ptmx", os.O_RDWR|unix.O_NOCTTY)
	if err != nil {
		return nil, nil, fmt.Errorf("open /dev/ptmx: %w", err)
	}
	fd := int(m.Fd())
	if err := unix.IoctlSetPointerInt(fd, unix.TIOCSPTLCK, 0); err != nil {
		m.Close()
		return nil, nil, fmt.Errorf("unlock pty: %w", err)
	}
	n, err := unix.IoctlGetInt(fd, unix.TIOCGPTN)
	if err != nil {
		m.Close()
		return nil, nil, fmt.Errorf("get pty number: %w", err)
	}
	// The master's own peer, by descriptor: no name in a /dev the
	// sandbox may have changed.
	tfd, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.TIOCGPTPEER, uintptr(unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC))
	if errno != 0 {
		m.Close()
		return nil, nil, fmt.Errorf("open pty /dev/pts/%d: %w", n, errno)
	}
	return m, os.NewFile(uintptr(tfd), "/dev/pts/"+strconv.Itoa(n)), nil
}

// openInRoot opens name (relative) inside root as a process whose root
// that is would (absolute links and .. stay inside it): the sandbox's /dev
// is the sandbox's to change, and a link there must not make this process
// open one of this machine's files.
func openInRoot(root, name string, flags int) (*os.File, error) {
	if root == "" {
		return os.OpenFile("/"+name, flags|unix.O_CLOEXEC, 0)
	}
	dir, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(dir)
	fd, err := unix.Openat2(dir, name, &unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC), Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS})
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), root+"/"+name)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR {
		f.Close()
		return nil, fmt.Errorf("%s is not a device", "/"+name)
	}
	return f, nil
}

// setWinsize resizes the terminal behind f.
func setWinsize(f *os.File, cols, rows uint32) error {
	if cols == 0 || rows == 0 {
		return nil
	}
	return unix.IoctlSetWinsize(int(f.Fd()), unix.TIOCSWINSZ, &unix.Winsize{Row: uint16(rows), Col: uint16(cols)})
}

// terminalSession is the session (its leader's pid, as seen here) whose
// controlling terminal is the one behind master.
func terminalSession(master *os.File) (int, error) {
	return unix.IoctlGetInt(int(master.Fd()), unix.TIOCGSID)
}

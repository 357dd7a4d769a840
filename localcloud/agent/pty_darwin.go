package agent

import (
	"bytes"
	"fmt"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// openPTY allocates a pseudo-terminal pair through /dev/ptmx (grantpt,
// unlockpt and ptsname are the TIOCPTY* ioctls on macOS). Built and vetted
// for macOS, not run by the tests here (they run on Linux).
func openPTY(_ string) (master, tty *os.File, err error) {
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("open /dev/ptmx: %w", err)
	}
	fd := int(m.Fd())
	if err := unix.IoctlSetInt(fd, unix.TIOCPTYGRANT, 0); err != nil {
		m.Close()
		return nil, nil, fmt.Errorf("grant pty: %w", err)
	}
	if err := unix.IoctlSetInt(fd, unix.TIOCPTYUNLK, 0); err != nil {
		m.Close()
		return nil, nil, fmt.Errorf("unlock pty: %w", err)
	}
	var name [128]byte
	if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), uintptr(unix.TIOCPTYGNAME), uintptr(unsafe.Pointer(&name[0]))); errno != 0 {
		m.Close()
		return nil, nil, fmt.Errorf("get pty name: %w", errno)
	}
	path := string(name[:bytes.IndexByte(name[:], 0)])
	t, err := os.OpenFile(path, os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		m.Close()
		return nil, nil, fmt.Errorf("open pty %s: %w", path, err)
	}
	return m, t, nil
}

// setWinsize resizes the terminal behind f.
func setWinsize(f *os.File, cols, rows uint32) error {
	if cols == 0 || rows == 0 {
		return nil
	}
	return unix.IoctlSetWinsize(int(f.Fd()), unix.TIOCSWINSZ, &unix.Winsize{Row: uint16(rows), Col: uint16(cols)})
}

// terminalSession is not needed here: without a sandbox the command on a
// terminal leads its own session, whose group signal reaches already.
func terminalSession(*os.File) (int, error) { return 0, syscall.ENOTSUP }

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
	m, err := os.OpenFile(root+"/dev/ptmx", os.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
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
	t, err := os.OpenFile(root+"/dev/pts/"+strconv.Itoa(n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		m.Close()
		return nil, nil, fmt.Errorf("open pty /dev/pts/%d: %w", n, err)
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

// terminalSession is the session (its leader's pid, as seen here) whose
// controlling terminal is the one behind master.
func terminalSession(master *os.File) (int, error) {
	return unix.IoctlGetInt(int(master.Fd()), unix.TIOCGSID)
}

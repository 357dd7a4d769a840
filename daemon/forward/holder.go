package forward

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// PortHolder names the process listening on local TCP port port, as
// "pid N (command line)", best effort: it reads /proc/net/tcp{,6} for the
// listening socket's inode and /proc/*/fd for its owner. It returns "" when
// nothing can be learned (no /proc, or the socket is not found).
func PortHolder(port int) string {
	inodes := map[string]bool{}
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		for _, ino := range listeningInodes(f, port) {
			inodes[ino] = true
		}
	}
	if len(inodes) == 0 {
		return ""
	}
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		fds, err := os.ReadDir(filepath.Join("/proc", p.Name(), "fd"))
		if err != nil {
			continue // another user's process, or gone
		}
		for _, fd := range fds {
			link, err := os.Readlink(filepath.Join("/proc", p.Name(), "fd", fd.Name()))
			if err != nil || !strings.HasPrefix(link, "socket:[") {
				continue
			}
			if inodes[strings.TrimSuffix(strings.TrimPrefix(link, "socket:["), "]")] {
				return describe(pid)
			}
		}
	}
	return "a process this user cannot see (another user's, or in another namespace)"
}

// listeningInodes returns the inodes of sockets listening on port in a
// /proc/net/tcp-format file.
func listeningInodes(file string, port int) []string {
	f, err := os.Open(file)
	if err != nil {
		return nil
	}
	defer f.Close()
	want := fmt.Sprintf(":%04X", port)
	var out []string
	sc := bufio.NewScanner(f)
	sc.Scan() // header
	for sc.Scan() {
		// sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
		fields := strings.Fields(sc.Text())
		if len(fields) < 10 || fields[3] != "0A" || !strings.HasSuffix(fields[1], want) {
			continue
		}
		if fields[9] != "0" {
			out = append(out, fields[9])
		}
	}
	return out
}

// describe is "pid N (command line)".
func describe(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	cmd := strings.TrimSpace(strings.ReplaceAll(string(b), "\x00", " "))
	if err != nil || cmd == "" {
		if c, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err == nil {
			cmd = strings.TrimSpace(string(c))
		}
	}
	if len(cmd) > 120 {
		cmd = cmd[:117] + "..."
	}
	if cmd == "" {
		return fmt.Sprintf("pid %d", pid)
	}
	return fmt.Sprintf("pid %d (%s)", pid, cmd)
}

//go:build linux

package sandbox

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The addresses of a run's network (network internet): its own, the
// gateway pasta needs to be told, and pasta's DNS forwarder. They are
// documentation addresses (RFC 5737), used by no network.
const (
	netAddr    = "198.51.100.2"
	netGateway = "198.51.100.1"
	netDNS     = "198.51.100.53"
)

// blockedRanges are the destinations a run with the internet must not
// reach: private, shared (CGNAT) and link-local ranges, where this
// machine's network and its neighbours' services are.
var blockedRanges = []string{"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "100.64.0.0/10", "0.0.0.0/8", netGateway + "/32"}

// resolvConf returns where the run's /etc/resolv.conf is (the file the
// machine's link names, when it is one) and a pipe holding the run's:
// pasta's forwarder.
func resolvConf() (string, *os.File, error) {
	dst := "/etc/resolv.conf"
	if t, err := filepath.EvalSymlinks(dst); err == nil && validPath(t) {
		dst = t
	}
	r, w, err := os.Pipe()
	if err != nil {
		return "", nil, fmt.Errorf("give the sandbox its resolver: %w", err)
	}
	defer w.Close()
	if _, err := w.WriteString("nameserver " + netDNS + "\n"); err != nil {
		r.Close()
		return "", nil, fmt.Errorf("give the sandbox its resolver: %w", err)
	}
	return dst, r, nil
}

// startNetwork connects the run's network namespace to the internet: pasta
// (started here, ended by Close) makes its interface and forwards its
// connections through this machine's sockets, and the namespace's routes
// refuse this machine's addresses and the private ranges. pasta maps no
// port either way and does not map its gateway to this machine's loopback.
func (s *Sandbox) startNetwork(ctx context.Context) error {
	netns, err := os.Open(fmt.Sprintf("/proc/%d/ns/net", s.pid))
	if err != nil {
		return fmt.Errorf("open the sandbox's network namespace: %w", err)
	}
	defer netns.Close()
	fd, err := unix.IoctlRetInt(int(netns.Fd()), unix.NS_GET_USERNS)
	if err != nil {
		return fmt.Errorf("find the owner of the sandbox's network namespace: %w", err)
	}
	owner := os.NewFile(uintptr(fd), "userns")
	defer owner.Close()
	args := []string{"--quiet", "--foreground", "--ipv4-only", "--config-net", "--no-map-gw",
		"-t", "none", "-u", "none", "-T", "none", "-U", "none",
		"-a", netAddr, "-n", "24", "-g", netGateway, "--dns-forward", netDNS,
		"--userns", "/proc/self/fd/3", "--netns", "/proc/self/fd/4"}
	if os.Geteuid() == 0 {
		// pasta would become nobody before joining the namespaces, which
		// nobody may not; it drops its capabilities and confines itself
		// once it has.
		args = append(args, "--runas", "0:0")
	}
	cmd := exec.Command(s.p.pasta, args...)
	cmd.ExtraFiles = []*os.File{owner, netns}
	cmd.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin"}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Pdeathsig: syscall.SIGKILL}
	var stderr strings.Builder
	cmd.Stderr = &limitedWriter{w: &stderr, n: 4096}
	if err := cmd.Start(); err != nil {
		return &netSetupError{fmt.Sprintf("start pasta, the sandbox's network: %v", err)}
	}
	s.pasta = cmd
	s.pastaDone = make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(s.pastaDone)
	}()
	script := s.routesScript()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	// pasta ending (it could not make the interface) ends the wait for it.
	go func() {
		select {
		case <-s.pastaDone:
			cancel()
		case <-ctx.Done():
		}
	}()
	argv := []string{s.p.nsent, "--target", strconv.Itoa(s.pid), "--net"}
	if s.ownerNS != nil {
		argv = []string{s.p.nsent, "--target", strconv.Itoa(s.pid), "--user=" + s.ownerNSPath, "--preserve-credentials", "--net"}
	} else if os.Geteuid() != 0 {
		argv = append(argv, "--user")
	}
	argv = append(argv, "--", "/bin/sh", "-c", script, "sandbox-network", s.p.ip)
	rc := exec.CommandContext(ctx, argv[0], argv[1:]...)
	rc.Env = []string{"PATH=/usr/bin:/bin"}
	rc.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Pdeathsig: syscall.SIGKILL}
	if out, err := rc.CombinedOutput(); err != nil {
		msg := strings.TrimSpace(string(out))
		select {
		case <-s.pastaDone:
			msg = "pasta ended; " + msg
		default:
			if ctx.Err() != nil {
				msg = "pasta did not make the sandbox's interface within 10s; " + msg
			}
		}
		return &netSetupError{fmt.Sprintf("set up the sandbox's network (network %q; or run localcloud with --network %s): %v: %s %s", NetworkInternet, NetworkLoopback, err, msg, strings.TrimSpace(stderr.String()))}
	}
	return nil
}

// netSetupError is a run's network that pasta could not set up (where
// /dev/net/tun is root's only, say): a default network falls back to
// loopback on it.
type netSetupError struct{ msg string }

func (e *netSetupError) Error() string { return e.msg }

// routesScript waits for pasta's interface, then routes everything to it
// but this machine's addresses and the private ranges, which are refused.
// $1 is ip.
func (s *Sandbox) routesScript() string {
	blocked := append([]string(nil), blockedRanges...)
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() {
				blocked = append(blocked, n.IP.To4().String()+"/32")
			}
		}
	}
	slices.Sort(blocked)
	blocked = slices.Compact(blocked)
	var b strings.Builder
	b.WriteString(`set -e; ip="$1"; i=0; while :; do dev=$("$ip" -o -4 addr show | awk '$2 != "lo" && /` + strings.ReplaceAll(netAddr, ".", `\.`) + `\// {print $2; exit}'); [ -n "$dev" ] && break; i=$((i+1)); [ $i -lt 1000 ] || { echo "no interface from pasta" >&2; exit 1; }; sleep 0.01; done; `)
	// One ip for every route.
	b.WriteString("\n\"$ip\" -batch - <<EOF\nroute flush table main\nroute add default dev $dev\n")
	for _, r := range blocked {
		fmt.Fprintf(&b, "route add prohibit %s\n", r)
	}
	b.WriteString("EOF\n")
	return b.String()
}

//go:build linux

package sandbox

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Provider starts the sandboxes of one localcloud.
type Provider struct {
	opts   Options
	report Report
	cg     *cgroups // nil: rlimits
	bwrap  string
	nsent  string
	setpv  string
	prlim  string
	sleep  string
	// leftovers is how many run groups of ended localclouds New removed.
	leftovers int
	// remap: this process is root, and sandboxes run as opts.HostUID.
	remap bool
	// viaDialer: port forwards go through a dialer process in the sandbox
	// (set once setns was refused: this process is not root).
	viaDialer atomic.Bool
	setsid    string
	// pasta and ip give a run the internet (network internet).
	pasta, ip string
	// inotifyErr says why a sandbox's inotify limits could not be set
	// (the probe's tells the report).
	inotifyErr atomic.Pointer[error]
}

// New checks what the machine provides, by starting and entering a probe
// sandbox. It fails with ErrUnavailable when namespaces cannot be had and
// opts.Isolation is not IsolationNone.
func New(ctx context.Context, opts Options) (*Provider, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	defaultNet := opts.Network == ""
	opts = opts.withDefaults()
	p := &Provider{opts: opts}
	if opts.Isolation == IsolationNone {
		p.report = Report{Isolation: IsolationNone, Protections: []string{}, HostUID: os.Geteuid(), Degraded: []string{"isolation is configured off (isolation: none)"}}
		return p, nil
	}
	for _, t := range []struct {
		name string
		dst  *string
		pkg  string
	}{{"bwrap", &p.bwrap, "bubblewrap"}, {"nsenter", &p.nsent, "util-linux"}, {"setpriv", &p.setpv, "util-linux"}, {"prlimit", &p.prlim, "util-linux"}, {"setsid", &p.setsid, "util-linux"}, {"sleep", &p.sleep, "coreutils"}} {
		path, err := exec.LookPath(t.name)
		if err != nil {
			return nil, fmt.Errorf("%w: %s is not installed: install the %s package (apt install %s), %s", ErrUnavailable, t.name, t.pkg, t.pkg, HowUnisolated)
		}
		*t.dst = path
	}
	var netDegraded string
	if opts.Network == NetworkInternet {
		pasta, perr := exec.LookPath("pasta")
		ip, ierr := exec.LookPath("ip")
		switch {
		case perr == nil && ierr == nil:
			p.pasta, p.ip = pasta, ip
		case !defaultNet && perr != nil:
			return nil, fmt.Errorf("%w: pasta is not installed (install the passt package), needed by network %q; or run with --network %s (loopback only)", ErrUnavailable, NetworkInternet, NetworkLoopback)
		case !defaultNet:
			return nil, fmt.Errorf("%w: ip is not installed (install the iproute2 package), needed by network %q; or run with --network %s (loopback only)", ErrUnavailable, NetworkInternet, NetworkLoopback)
		default:
			opts.Network = NetworkLoopback
			p.opts = opts
			netDegraded = "network: loopback only, pasta or ip is not installed (install the passt and iproute2 packages for the internet)"
		}
	}
	p.report = Report{Isolation: IsolationNamespaces, Mechanism: "bubblewrap", Network: opts.Network, Shared: opts.Share,
		Protections: []string{"user-namespace", "mount-namespace", "pid-namespace", "uts-namespace", "ipc-namespace"},
		Limits:      map[string]string{}}
	p.report.HostUID = os.Geteuid()
	if os.Geteuid() == 0 {
		p.remap = true
		p.report.HostUID = opts.HostUID
		p.report.Protections = append(p.report.Protections, "unprivileged-user")
	}
	if netDegraded != "" {
		p.report.Degraded = append(p.report.Degraded, netDegraded)
	}
	if opts.Network != NetworkHost {
		p.report.Protections = append(p.report.Protections, "net-namespace")
	} else {
		p.report.Degraded = append(p.report.Degraded, "network: the host's network is shared (network: host)")
	}
	base := p.report
	base.Protections = slices.Clone(base.Protections)
	base.Degraded = slices.Clone(base.Degraded)
	cg, err := newCgroups(opts.CgroupRoot)
	if err == nil {
		p.cg = cg
		p.leftovers = cg.removeLeftovers()
	}
	p.report = p.limitsReport(base, err)
	// Probe: a sandbox that starts and can be entered; if its groups are
	// what fails, without them.
	perr := p.probe(ctx)
	var nerr *netSetupError
	if perr != nil && defaultNet && p.opts.Network == NetworkInternet && errors.As(perr, &nerr) {
		// The default network cannot be had here: loopback only, said.
		p.opts.Network = NetworkLoopback
		why := fmt.Sprintf("network: loopback only, pasta could not connect the sandbox (%s)", nerr.msg)
		for _, r := range []*Report{&base, &p.report} {
			r.Network = NetworkLoopback
			r.Degraded = append(r.Degraded, why)
		}
		perr = p.probe(ctx)
	}
	if perr != nil && p.cg != nil {
		p.cg = nil
		p.report = p.limitsReport(base, fmt.Errorf("the run groups could not be used (%v)", perr))
		perr = p.probe(ctx)
	}
	if perr != nil {
		return nil, perr
	}
	p.report = p.storageReport(p.report)
	return p, nil
}

// storageReport adds to r the limits every isolated run has whatever
// the cgroups: its files on disk, one file's size, inotify.
func (p *Provider) storageReport(r Report) Report {
	r.Limits["disk"] = "watchdog"
	r.Limits["file-size"] = "rlimit"
	r.Protections = append(r.Protections, "disk-limit", "file-size-limit")
	if e := p.inotifyErr.Load(); e != nil {
		r.Limits["inotify"] = "none"
		r.Degraded = append(r.Degraded, fmt.Sprintf("inotify: the run's limits could not be set (%v); a sandbox can use up the host user's", *e))
	} else {
		r.Limits["inotify"] = "userns"
		r.Protections = append(r.Protections, "inotify-limit")
	}
	return r
}

// limitsReport adds to base how the limits are enforced: by p.cg, or by
// rlimits when cgErr says why there are no groups.
func (p *Provider) limitsReport(base Report, cgErr error) Report {
	r := base
	r.Protections = slices.Clone(base.Protections)
	r.Degraded = slices.Clone(base.Degraded)
	if p.cg != nil {
		kind := "cgroup-v1"
		if p.cg.v2 {
			kind = "cgroup-v2"
		}
		r.Protections = append(r.Protections, "memory-limit", "process-limit", "cpu-share")
		r.Limits = map[string]string{"memory": kind, "processes": kind, "cpu": kind}
		return r
	}
	r.Limits = map[string]string{"memory": "rlimit", "processes": "rlimit", "cpu": "none"}
	r.Protections = append(r.Protections, "memory-rlimit")
	r.Degraded = append(r.Degraded, fmt.Sprintf("cgroups: %v; memory is an address-space rlimit, a run over it is not ended, CPU is not limited", cgErr))
	switch {
	case p.remap:
		r.Protections = append(r.Protections, "process-rlimit")
		r.Degraded = append(r.Degraded, fmt.Sprintf("processes: RLIMIT_NPROC counts all of the sandbox user's (uid %d) processes, every run's together", p.opts.HostUID))
	case os.Geteuid() == 0:
		r.Degraded = append(r.Degraded, "processes: RLIMIT_NPROC does not apply to root, a fork bomb is not contained")
	default:
		r.Protections = append(r.Protections, "process-rlimit")
		r.Degraded = append(r.Degraded, "processes: RLIMIT_NPROC counts all of the user's processes, not one run's")
	}
	return r
}

// probe starts a sandbox and runs a command in it.
func (p *Provider) probe(ctx context.Context) error {
	dir, err := os.MkdirTemp("", "sandboxd-probe-")
	if err != nil {
		return fmt.Errorf("probe the sandbox: %w", err)
	}
	defer os.RemoveAll(dir)
	sb, err := p.Start(ctx, Spec{ID: "probe", Workspace: dir})
	if err != nil {
		return fmt.Errorf("%w: %w (%s)", ErrUnavailable, err, HowUnisolated)
	}
	defer sb.Close()
	if out, err := sb.Command(ctx, dir, "/bin/sh", "-c", "echo ok").CombinedOutput(); err != nil || strings.TrimSpace(string(out)) != "ok" {
		return fmt.Errorf("%w: entering the probe sandbox failed: %v: %s (%s)", ErrUnavailable, err, strings.TrimSpace(string(out)), HowUnisolated)
	}
	return nil
}

// Report says which protections are active.
func (p *Provider) Report() Report { return p.report }

// RemovedLeftovers is how many run cgroups left by localclouds that ended
// without removing them (SIGKILLed) New removed.
func (p *Provider) RemovedLeftovers() int { return p.leftovers }

// newUserNS makes the user namespace of a sandbox of a root localcloud:
// its root is the unprivileged host user opts.HostUID (what every command
// runs as), and host root is its uid 1, only so that bubblewrap, started
// as root, can build the sandbox (no process of the sandbox runs as it but
// bubblewrap's own, with every capability dropped).
func (p *Provider) newUserNS() (*os.File, error) {
	cmd := exec.Command(p.sleep, "infinity")
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:                 syscall.CLONE_NEWUSER,
		UidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: p.opts.HostUID, Size: 1}, {ContainerID: 1, HostID: 0, Size: 1}},
		GidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: p.opts.HostGID, Size: 1}, {ContainerID: 1, HostID: 0, Size: 1}},
		GidMappingsEnableSetgroups: true,
		Pdeathsig:                  syscall.SIGKILL,
		Setsid:                     true,
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("create the sandbox's user namespace: %w", err)
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	f, err := os.Open(fmt.Sprintf("/proc/%d/ns/user", cmd.Process.Pid))
	if err != nil {
		return nil, fmt.Errorf("open the sandbox's user namespace: %w", err)
	}
	return f, nil
}

// pathTo makes, in a remapped sandbox, the directories leading to dir
// traversable by the sandbox's user: bubblewrap would make them with the
// modes of this machine's (0700 ones of root in localcloud's state
// directory). Below a shared directory, the first of them is replaced by
// an empty one (the rest of that part of the share, localcloud's state
// for one, is not seen). made holds the directories already made.
func (p *Provider) pathTo(dir string, made map[string]bool) []string {
	var args []string
	parent := filepath.Dir(dir)
	for i := 1; i <= len(parent); i++ {
		if i < len(parent) && parent[i] != '/' {
			continue
		}
		a := parent[:i]
		if made[a] {
			continue
		}
		made[a] = true
		op := "--dir"
		for _, sh := range p.opts.Share {
			if a == sh {
				op = "" // the share itself, as it is
				break
			}
			if strings.HasPrefix(a, sh+"/") && !underTmpfs(a, made) {
				op = "--tmpfs"
			}
		}
		switch op {
		case "":
		case "--tmpfs":
			made[a+"\x00tmpfs"] = true
			args = append(args, "--perms", "0755", "--tmpfs", a)
		default:
			args = append(args, "--perms", "0755", "--dir", a)
		}
	}
	return args
}

// underTmpfs reports whether an ancestor of a was replaced by pathTo.
func underTmpfs(a string, made map[string]bool) bool {
	for d := filepath.Dir(a); d != "/" && d != "."; d = filepath.Dir(d) {
		if made[d+"\x00tmpfs"] {
			return true
		}
	}
	return false
}

// chownTree gives dir and everything below to uid:gid. It walks by
// descriptors and changes links themselves, never what they name, and
// stays on dir's filesystem: the tree may hold what a sandbox made.
func chownTree(dir string, uid, gid int) error {
	if dir == "" {
		return nil
	}
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("give the sandbox's user (uid %d) the run's directory: %w", uid, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return fmt.Errorf("give the sandbox's user (uid %d) the run's directory: %w", uid, err)
	}
	if err := unix.Fchown(fd, uid, gid); err != nil {
		unix.Close(fd)
		return fmt.Errorf("give the sandbox's user (uid %d) %s: %w", uid, dir, err)
	}
	if err := chownBelow(fd, st.Dev, uid, gid, 0); err != nil {
		return fmt.Errorf("give the sandbox's user (uid %d) the run's directory %s: %w", uid, dir, err)
	}
	return nil
}

// chownBelow gives the entries of the directory fd (which it closes) to
// uid:gid.
func chownBelow(fd int, dev uint64, uid, gid, depth int) error {
	f := os.NewFile(uintptr(fd), "dir")
	defer f.Close()
	for {
		names, rerr := f.Readdirnames(1024)
		for _, name := range names {
			var st unix.Stat_t
			if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			if st.Dev != dev {
				continue
			}
			if err := unix.Fchownat(fd, name, uid, gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			if st.Mode&unix.S_IFMT != unix.S_IFDIR {
				continue
			}
			if depth >= maxDiskDepth {
				return fmt.Errorf("%s: directories nested deeper than %d", name, maxDiskDepth)
			}
			sub, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			if err := chownBelow(sub, dev, uid, gid, depth+1); err != nil {
				return fmt.Errorf("%s/%w", name, err)
			}
		}
		if rerr != nil {
			if errors.Is(rerr, io.EOF) {
				return nil
			}
			return rerr
		}
	}
}

// LogDir is the directory of localcloud's the sandbox sees read-only at
// the same path (Spec.Logs; "" when none).
func (s *Sandbox) LogDir() string { return s.spec.Logs }

// Sandbox is one run's isolated environment.
type Sandbox struct {
	p         *Provider
	spec      Spec
	holder    *exec.Cmd
	pid       int // the namespaces' init, as seen from here
	cgDirs    []string
	done      chan struct{}
	closeOnce sync.Once
	dialer    dialer
	spawner   spawnerSlot
	// ownerNS is the user namespace owning the sandbox's other namespaces
	// when it is not the one its processes run in (bubblewrap nests one
	// when not run as root); nil otherwise. nsPID is the holder's pid
	// inside the sandbox.
	ownerNS     *os.File
	ownerNSPath string
	nsPID       int
	// pasta is the run's user-space network (network internet);
	// pastaDone is closed when it has ended.
	pasta     *exec.Cmd
	pastaDone chan struct{}
}

// findOwnerNS sets ownerNS when the sandbox's namespaces are owned by a
// user namespace its processes are not in.
func (s *Sandbox) findOwnerNS() error {
	ipc, err := os.Open(fmt.Sprintf("/proc/%d/ns/ipc", s.pid))
	if err != nil {
		return fmt.Errorf("open the sandbox's namespaces: %w", err)
	}
	defer ipc.Close()
	fd, err := unix.IoctlRetInt(int(ipc.Fd()), unix.NS_GET_USERNS)
	if err != nil {
		return fmt.Errorf("find the sandbox's user namespace: %w", err)
	}
	owner := os.NewFile(uintptr(fd), "userns")
	var a, b unix.Stat_t
	if err := unix.Fstat(fd, &a); err != nil {
		owner.Close()
		return fmt.Errorf("find the sandbox's user namespace: %w", err)
	}
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/user", s.pid), &b); err != nil {
		owner.Close()
		return fmt.Errorf("find the sandbox's user namespace: %w", err)
	}
	if a.Ino == b.Ino && a.Dev == b.Dev {
		owner.Close()
		return nil
	}
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", s.pid))
	if err != nil {
		owner.Close()
		return fmt.Errorf("read the sandbox holder's status: %w", err)
	}
	for _, line := range strings.Split(string(st), "\n") {
		if f := strings.Fields(line); len(f) > 1 && f[0] == "NSpid:" {
			s.nsPID, _ = strconv.Atoi(f[len(f)-1])
		}
	}
	if s.nsPID <= 0 {
		owner.Close()
		return errors.New("the sandbox holder's pid inside the sandbox is not known")
	}
	// nsenter opens it through this process's descriptor table.
	s.ownerNS = owner
	s.ownerNSPath = fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), owner.Fd())
	return nil
}

// Start creates run spec's namespaces. With isolation none it returns a
// sandbox whose commands are plain processes.
func (p *Provider) Start(ctx context.Context, spec Spec) (*Sandbox, error) {
	s := &Sandbox{p: p, spec: spec, done: make(chan struct{})}
	if p.opts.Isolation == IsolationNone {
		return s, nil
	}
	if !validPath(spec.Workspace) || (spec.Home != "" && !validPath(spec.Home)) || (spec.Logs != "" && !validPath(spec.Logs)) {
		return nil, fmt.Errorf("sandbox paths must be absolute and clean: %q, %q, %q", spec.Workspace, spec.Home, spec.Logs)
	}
	if p.cg != nil {
		dirs, err := p.cg.create(spec.ID, p.opts)
		if err != nil {
			return nil, err
		}
		s.cgDirs = dirs
	}
	var userns *os.File
	if p.remap {
		// Root: the sandbox runs as an unprivileged host user, which
		// must own the run's directories.
		for _, d := range []string{spec.Workspace, spec.Home} {
			if err := chownTree(d, p.opts.HostUID, p.opts.HostGID); err != nil {
				s.removeCgroups()
				return nil, err
			}
		}
		f, err := p.newUserNS()
		if err != nil {
			s.removeCgroups()
			return nil, err
		}
		defer f.Close()
		userns = f
	}
	args := []string{"--unshare-user"}
	if userns != nil {
		args = []string{"--userns", "4"} // see ExtraFiles
	}
	// --new-session: nothing in the sandbox has localcloud's controlling
	// terminal (TIOCSTI would type into it).
	args = append(args, "--unshare-pid", "--unshare-uts", "--unshare-ipc", "--new-session",
		"--hostname", hostname(spec.ID), "--die-with-parent", "--cap-drop", "ALL")
	if p.opts.Network != NetworkHost {
		args = append(args, "--unshare-net")
	}
	// The system, read-only; merged-/usr symlinks kept as symlinks.
	for _, d := range []string{"/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt"} {
		fi, err := os.Lstat(d)
		if err != nil {
			continue
		}
		if fi.Mode()&os.ModeSymlink != 0 {
			if t, err := os.Readlink(d); err == nil {
				args = append(args, "--symlink", t, d)
			}
			continue
		}
		args = append(args, "--ro-bind", d, d)
	}
	var resolv *os.File
	if p.opts.Network == NetworkInternet {
		// The run's resolver is pasta's DNS forwarder: the machine's
		// nameserver may be on its loopback or a private address, which
		// the run does not reach.
		dst, r, err := resolvConf()
		if err != nil {
			s.removeCgroups()
			return nil, err
		}
		defer r.Close()
		resolv = r
		fd := 4
		if userns != nil {
			fd = 5
		}
		args = append(args, "--ro-bind-data", strconv.Itoa(fd), dst)
	}
	// Made by bubblewrap's user, writable by everyone (the sandbox's
	// user is another one when remapped).
	// Their files are memory: each is bounded by the run's memory limit
	// (which cgroups also charge them to).
	size := strconv.FormatInt(p.opts.MemoryBytes, 10)
	args = append(args, "--proc", "/proc", "--dev", "/dev", "--perms", "01777", "--size", size, "--tmpfs", "/dev/shm",
		"--perms", "01777", "--size", size, "--tmpfs", "/tmp", "--perms", "01777", "--size", size, "--tmpfs", "/var/tmp")
	made := map[string]bool{"/": true, "/tmp": true, "/var/tmp": true}
	for _, d := range p.opts.Share { // before the workspace, which may lie below
		if userns != nil {
			args = append(args, p.pathTo(d, made)...)
		}
		args = append(args, "--bind", d, d)
	}
	for _, d := range p.opts.Toolchains {
		if _, err := os.Stat(d); err != nil {
			continue // bubblewrap would refuse the whole sandbox
		}
		if userns != nil {
			args = append(args, p.pathTo(d, made)...)
		}
		args = append(args, "--ro-bind", d, d)
	}
	for _, d := range []string{spec.Workspace, spec.Home} {
		if d == "" {
			continue
		}
		if userns != nil {
			args = append(args, p.pathTo(d, made)...)
		}
		args = append(args, "--bind", d, d)
	}
	if spec.Logs != "" {
		// localcloud's: the sandbox reads them, never changes them.
		if userns != nil {
			args = append(args, p.pathTo(spec.Logs, made)...)
		}
		args = append(args, "--ro-bind", spec.Logs, spec.Logs)
	}
	// Nothing else is writable: not the directories made to hold the
	// mount points.

	// The holder waits in the workspace, whose directory nsenter enters;
	// remapped, it runs as host root without capabilities, which cannot
	// enter the sandbox user's workspace: it waits at the root.
	wd := spec.Workspace
	if userns != nil {
		wd = "/"
	}
	args = append(args, "--remount-ro", "/", "--chdir", wd, "--info-fd", "3", "--", "/bin/sh", "-c", "echo ready; exec sleep infinity")
	argv := p.enterCgroups(s.cgDirs, append([]string{p.bwrap}, args...))
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin"}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Pdeathsig: syscall.SIGKILL}
	info, infoW, err := os.Pipe()
	if err != nil {
		s.removeCgroups()
		return nil, fmt.Errorf("start the sandbox: %w", err)
	}
	defer info.Close()
	cmd.ExtraFiles = []*os.File{infoW} // descriptor 3
	if userns != nil {
		cmd.ExtraFiles = append(cmd.ExtraFiles, userns) // 4
	}
	if resolv != nil {
		cmd.ExtraFiles = append(cmd.ExtraFiles, resolv) // 4 or 5
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		infoW.Close()
		s.removeCgroups()
		return nil, fmt.Errorf("start the sandbox: %w", err)
	}
	var stderr strings.Builder
	cmd.Stderr = &limitedWriter{w: &stderr, n: 4096}
	if err := cmd.Start(); err != nil {
		infoW.Close()
		s.removeCgroups()
		return nil, fmt.Errorf("start bubblewrap: %w", err)
	}
	infoW.Close()
	s.holder = cmd
	type result struct {
		pid int
		err error
	}
	ready := make(chan result, 1)
	go func() {
		var in struct {
			ChildPID int `json:"child-pid"`
		}
		if err := json.NewDecoder(info).Decode(&in); err != nil {
			ready <- result{err: fmt.Errorf("read the sandbox's pid: %w", err)}
			return
		}
		line, err := bufio.NewReader(stdout).ReadString('\n')
		if err != nil || line != "ready\n" {
			ready <- result{err: fmt.Errorf("the sandbox did not start: %v", err)}
			return
		}
		ready <- result{pid: in.ChildPID}
	}()
	var r result
	select {
	case r = <-ready:
	case <-ctx.Done():
		r.err = ctx.Err()
	case <-time.After(30 * time.Second):
		r.err = errors.New("the sandbox did not start within 30s")
	}
	if r.err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		s.removeCgroups()
		return nil, fmt.Errorf("%w: %s", r.err, strings.TrimSpace(stderr.String()))
	}
	s.pid = r.pid
	go func() {
		_ = cmd.Wait()
		close(s.done)
	}()
	if err := s.findOwnerNS(); err != nil {
		s.Close()
		return nil, err
	}
	if p.opts.Network == NetworkInternet {
		if err := s.startNetwork(ctx); err != nil {
			s.Close()
			return nil, err
		}
	}
	if err := s.limitInotify(ctx); err != nil {
		// Reported by status (the probe's sandbox sets it first).
		p.inotifyErr.Store(&err)
		s.log().Warn("the run's inotify limits could not be set", "err", err)
	}
	return s, nil
}

// limitInotify gives the sandbox's user namespace its own inotify limits.
// They are per user namespace, and what a namespace's processes use is
// charged to it and to every namespace above it, up to the host user's:
// the run's own limits keep a sandbox from taking all of the host user's.
// Set from inside the namespace, as its root before any capability is
// dropped (only CAP_SYS_RESOURCE there may write them; the sandbox's
// commands have none).
func (s *Sandbox) limitInotify(ctx context.Context) error {
	script := fmt.Sprintf("echo %d > /proc/sys/user/max_inotify_instances && echo %d > /proc/sys/user/max_inotify_watches",
		s.p.opts.InotifyInstances, s.p.opts.InotifyWatches)
	argv := []string{s.p.nsent, "--target", strconv.Itoa(s.pid), "--user", "--", "/bin/sh", "-c", script}
	if s.ownerNS != nil {
		// The namespace owning the sandbox's, made by bubblewrap, whose
		// root this user is (joined as it is: setgroups is denied
		// there). Its limits bound the namespaces below it.
		argv = []string{s.p.nsent, "--target", strconv.Itoa(s.pid), "--user=" + s.ownerNSPath, "--preserve-credentials", "--", "/bin/sh", "-c", script}
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Env = []string{"PATH=/usr/bin:/bin"}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Pdeathsig: syscall.SIGKILL}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("set the inotify limits in the run's user namespace: %w: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// enterCgroups prefixes argv with a shell that moves itself into dirs
// (so that everything argv starts is counted from its first instruction)
// or, without cgroups, with prlimit setting the rlimits.
func (p *Provider) enterCgroups(dirs []string, argv []string) []string {
	fsize := "--fsize=" + strconv.FormatInt(p.opts.FileBytes, 10)
	if p.cg == nil {
		return append([]string{p.prlim, "--as=" + strconv.FormatInt(p.opts.MemoryBytes, 10), "--nproc=" + strconv.Itoa(p.opts.MaxProcs), fsize, "--"}, argv...)
	}
	// One file a command writes is bounded (RLIMIT_FSIZE: the write
	// fails with EFBIG, SIGXFSZ ends a writer that does not handle it).
	argv = append([]string{p.prlim, fsize, "--"}, argv...)
	var b strings.Builder
	for _, d := range dirs {
		fmt.Fprintf(&b, "echo $$ > '%s/cgroup.procs' || exit 125; ", d)
	}
	b.WriteString(`exec "$@"`)
	return append([]string{"/bin/sh", "-c", b.String(), "sandbox"}, argv...)
}

// Command returns argv to run in the sandbox, in dir (the workspace or
// below, or the run's home). The process runs as root of the sandbox's
// user namespace with every capability dropped. It leads a new session,
// without a controlling terminal (SysProcAttr is set; a caller that
// replaces it keeps Setsid).
func (s *Sandbox) Command(ctx context.Context, dir string, argv ...string) *exec.Cmd {
	cmd := s.command(ctx, dir, argv...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	return cmd
}

func (s *Sandbox) command(ctx context.Context, dir string, argv ...string) *exec.Cmd {
	if s.holder == nil {
		cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
		cmd.Dir = dir
		return cmd
	}
	// nsenter enters the holder's working directory (the workspace, or
	// the root when remapped); another directory is changed to inside.
	if dir == "" {
		dir = s.spec.Workspace
	}
	if filepath.Clean(dir) != s.spec.Workspace || s.p.remap {
		argv = append([]string{"/bin/sh", "-c", `cd -- "$0" && exec "$@"`, dir}, argv...)
	}
	var full []string
	if s.ownerNS == nil {
		full = []string{s.p.nsent, "--target", strconv.Itoa(s.pid), "--user", "--mount", "--pid", "--uts", "--ipc"}
	} else {
		// The namespaces belong to the user namespace outside the one the
		// sandbox's processes are in: enter that one (where this user has
		// the capabilities setns needs) to join them, then the inner one.
		full = []string{s.p.nsent, "--target", strconv.Itoa(s.pid), "--user=" + s.ownerNSPath, "--preserve-credentials", "--mount", "--pid", "--uts", "--ipc"}
	}
	if s.p.opts.Network != NetworkHost {
		full = append(full, "--net")
	}
	full = append(full, "--root", "--wd", "--")
	if s.ownerNS != nil {
		full = append(full, s.p.nsent, "--preserve-credentials", "--user=/proc/"+strconv.Itoa(s.nsPID)+"/ns/user", "--")
	}
	full = append(full, s.p.setpv, "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--")
	full = s.p.enterCgroups(s.cgDirs, append(full, argv...))
	return exec.CommandContext(ctx, full[0], full[1:]...)
}

// TerminalCommand is Command for a program on a terminal, which the
// caller gives the command as stdin, stdout and stderr: the program leads
// a new session whose controlling terminal is that terminal. Under
// isolation that is done inside the namespaces (setsid --ctty), not by the
// process started here: a session or process group made outside has no
// number in the sandbox's PID namespace, and a shell with job control
// could not give the terminal back to it at exit ("Cannot set tty process
// group"). The command started here gets a session of its own without a
// controlling terminal (SysProcAttr is set; the caller may add to it).
func (s *Sandbox) TerminalCommand(ctx context.Context, dir string, argv ...string) *exec.Cmd {
	if s.holder == nil {
		cmd := s.Command(ctx, dir, argv...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
		return cmd
	}
	cmd := s.Command(ctx, dir, append([]string{s.p.setsid, "--ctty"}, argv...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	return cmd
}

// DialTCP connects to addr in the sandbox's network (its loopback), for
// port forwards.
func (s *Sandbox) DialTCP(ctx context.Context, addr string) (net.Conn, error) {
	var d net.Dialer
	if s.holder == nil || s.p.opts.Network == NetworkHost {
		return d.DialContext(ctx, "tcp", addr)
	}
	if s.p.viaDialer.Load() {
		return s.dialer.dial(ctx, s, addr)
	}
	// Root: the socket is created on a thread moved into the sandbox's
	// network namespace; a connected socket stays in the namespace it was
	// made in.
	type result struct {
		c      net.Conn
		err    error
		denied bool
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: fmt.Errorf("open this thread's network namespace: %w", err)}
			return
		}
		defer orig.Close()
		target, err := os.Open(fmt.Sprintf("/proc/%d/ns/net", s.pid))
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: fmt.Errorf("open the sandbox's network namespace: %w", err)}
			return
		}
		defer target.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: fmt.Errorf("enter the sandbox's network namespace: %w", err), denied: errors.Is(err, unix.EPERM)}
			return
		}
		c, err := d.DialContext(ctx, "tcp", addr)
		if unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET) == nil {
			runtime.UnlockOSThread()
		} // else the thread stays locked and exits with this goroutine
		ch <- result{c: c, err: err}
	}()
	r := <-ch
	if r.denied {
		// Not root: from now on, through the sandbox's dialer.
		s.p.viaDialer.Store(true)
		return s.dialer.dial(ctx, s, addr)
	}
	return r.c, r.err
}

func (s *Sandbox) log() *slog.Logger {
	if s.spec.Logger != nil {
		return s.spec.Logger
	}
	return slog.New(slog.DiscardHandler)
}

// DevRoot is the sandbox's root as seen from here, for opening a terminal
// in its own /dev/pts ("" without isolation).
func (s *Sandbox) DevRoot() string {
	if s.holder == nil {
		return ""
	}
	return fmt.Sprintf("/proc/%d/root", s.pid)
}

// Done is closed when the sandbox has ended (closed, or its holder died).
func (s *Sandbox) Done() <-chan struct{} { return s.done }

// OOMKilled reports whether the kernel killed a process of the sandbox
// for exceeding its memory limit.
func (s *Sandbox) OOMKilled() bool {
	for _, d := range s.cgDirs {
		// v1's memory.oom_control or v2's memory.events (the other group
		// of v1, pids or cpu, has neither).
		b, err := os.ReadFile(filepath.Join(d, "memory.oom_control"))
		if errors.Is(err, os.ErrNotExist) {
			b, err = os.ReadFile(filepath.Join(d, "memory.events"))
		}
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) == 2 && f[0] == "oom_kill" && f[1] != "0" {
				return true
			}
		}
	}
	return false
}

// DiskCheckEvery is how often the run's files are to be measured.
func (s *Sandbox) DiskCheckEvery() time.Duration { return s.p.opts.DiskCheckEvery }

// OverDiskLimit measures what the run's files (workspace, home, process
// logs) take on disk and reports it, and whether that is over the run's
// disk limit (false without isolation: no limit then).
func (s *Sandbox) OverDiskLimit() (used, limit int64, over bool) {
	if s.holder == nil {
		return 0, 0, false
	}
	seen := map[[2]uint64]bool{}
	for _, d := range []string{s.spec.Workspace, s.spec.Home, s.spec.Logs} {
		if d != "" {
			used += diskUsage(d, seen)
		}
	}
	return used, s.p.opts.DiskBytes, used > s.p.opts.DiskBytes
}

// diskUsage is what the tree at dir takes on disk (allocated blocks, each
// inode once). It walks by descriptors, never following a link, and stays
// on dir's filesystem: the sandbox changes the tree meanwhile and must
// not make this process measure, or open, anything else.
func diskUsage(dir string, seen map[[2]uint64]bool) int64 {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0
	}
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil {
		unix.Close(fd)
		return 0
	}
	return st.Blocks*512 + usageBelow(fd, st.Dev, seen, 0)
}

// maxDiskDepth bounds the directories the measure descends (one open
// descriptor each); deeper ones are not counted.
const maxDiskDepth = 512

// usageBelow measures the entries of the directory fd (which it closes).
func usageBelow(fd int, dev uint64, seen map[[2]uint64]bool, depth int) int64 {
	f := os.NewFile(uintptr(fd), "dir")
	defer f.Close()
	var total int64
	for {
		names, err := f.Readdirnames(1024)
		for _, name := range names {
			var st unix.Stat_t
			if unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil || st.Dev != dev {
				continue
			}
			if st.Nlink > 1 && st.Mode&unix.S_IFMT != unix.S_IFDIR {
				// A file with other links is counted once.
				key := [2]uint64{st.Dev, st.Ino}
				if seen[key] {
					continue
				}
				seen[key] = true
			}
			total += st.Blocks * 512
			if st.Mode&unix.S_IFMT == unix.S_IFDIR && depth < maxDiskDepth {
				sub, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
				if err == nil {
					total += usageBelow(sub, dev, seen, depth+1)
				}
			}
		}
		if err != nil {
			return total
		}
	}
}

// Close kills everything in the sandbox: the end of the PID namespace's
// init takes every process in it along.
func (s *Sandbox) Close() error {
	s.closeOnce.Do(func() {
		if s.holder == nil {
			close(s.done)
			return
		}
		// bubblewrap reaps its child and exits; killed itself only when it
		// does not (killing it first would leave its child a zombie for
		// init to reap).
		if s.pid > 0 {
			_ = syscall.Kill(s.pid, syscall.SIGKILL)
		}
		select {
		case <-s.done:
		case <-time.After(5 * time.Second):
			_ = s.holder.Process.Kill()
			<-s.done
		}
		s.dialer.close()
		s.spawner.close()
		if s.pasta != nil {
			_ = s.pasta.Process.Kill()
			<-s.pastaDone
		}
		if s.ownerNS != nil {
			s.ownerNS.Close()
		}
		s.removeCgroups()
	})
	return nil
}

func (s *Sandbox) removeCgroups() {
	for _, d := range s.cgDirs {
		// The last processes may take a moment to leave.
		for i := 0; i < 50; i++ {
			if err := os.Remove(d); err == nil || os.IsNotExist(err) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

func validPath(p string) bool {
	return filepath.IsAbs(p) && filepath.Clean(p) == p && !strings.ContainsAny(p, "'\n")
}

// hostname is the run's hostname: "nook-" and the run id, cut to a label.
func hostname(id string) string {
	h := "nook-" + strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-' {
			return r
		}
		if r >= 'A' && r <= 'Z' {
			return r + 'a' - 'A'
		}
		return '-'
	}, id)
	if len(h) > 63 {
		h = h[:63]
	}
	return h
}

type limitedWriter struct {
	w io.Writer
	n int
}

func (l *limitedWriter) Write(p []byte) (int, error) {
	if l.n <= 0 {
		return len(p), nil
	}
	q := p
	if len(q) > l.n {
		q = q[:l.n]
	}
	l.n -= len(q)
	_, _ = l.w.Write(q)
	return len(p), nil
}

// Package sandbox isolates the commands of one localcloud run: every
// command of a run (setup steps, agent commands, shells, background
// processes) enters one long-lived set of Linux namespaces held by a
// bubblewrap process started for the run, so they share a private mount
// table (only the run's workspace, its home and a private /tmp writable;
// the user's home and localcloud's state invisible), a private PID
// namespace (ending the run kills everything in it), a hostname and,
// unless configured otherwise, a network namespace with loopback only.
// Resource limits come from cgroups where this process may create them,
// from rlimits otherwise.
package sandbox

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Isolation levels.
const (
	// IsolationNamespaces is the default: commands run in namespaces, and
	// localcloud refuses to start sandboxes when the machine cannot
	// provide them.
	IsolationNamespaces = "namespaces"
	// IsolationNone runs commands as plain processes of the user, with the
	// user's whole machine in reach; only when configured explicitly.
	IsolationNone = "none"
)

// Network modes.
const (
	// NetworkInternet (the default) gives each run its own network
	// namespace that reaches the internet as a rootless container does,
	// through pasta (user-space networking), while this machine's loopback,
	// its own addresses and the private ranges stay out of reach.
	NetworkInternet = "internet"
	// NetworkLoopback gives each run its own network namespace with only a
	// loopback interface: the run's processes reach each other and port
	// forwards reach them, nothing else does.
	NetworkLoopback = "loopback"
	// NetworkHost shares the machine's network.
	NetworkHost = "host"
)

// HowUnisolated says how to run sandboxes without isolation, the way out
// when the machine cannot isolate them.
const HowUnisolated = "or run sandboxes unisolated: sandboxd-localcloud --isolation none, or SANDBOXD_LOCALCLOUD_ISOLATION=none in the environment that starts it (sandboxd's, which passes it on; then `sandboxd-localcloud stop` so that it restarts with it)"

// Options configure isolation for every run of a localcloud.
type Options struct {
	// Isolation is IsolationNamespaces ("" means it) or IsolationNone.
	Isolation string
	// Network is NetworkInternet ("" means it: loopback only, reported
	// as degraded, when pasta is not installed), NetworkLoopback or
	// NetworkHost.
	Network string
	// MemoryBytes, MaxProcs and CPUShares limit each run; defaults when 0
	// (DefaultMemoryBytes, DefaultMaxProcs, DefaultCPUShares).
	MemoryBytes int64
	MaxProcs    int
	CPUShares   int
	// DiskBytes bounds what a run's files (workspace, home, process logs)
	// take on this machine's disk: a run over it is ended. FileBytes
	// bounds one file a command writes (RLIMIT_FSIZE). Defaults when 0
	// (DefaultDiskBytes, DefaultFileBytes); DiskCheckEvery is how often
	// the run's files are measured (DefaultDiskCheckEvery when 0).
	DiskBytes      int64
	FileBytes      int64
	DiskCheckEvery time.Duration
	// InotifyInstances and InotifyWatches are the run's own limits on
	// inotify (set in its user namespace, so that a sandbox cannot take
	// the host user's); when 0, DefaultInotifyInstances and
	// DefaultInotifyWatches, at most a quarter of the host's.
	InotifyInstances int
	InotifyWatches   int
	// Share are directories of this machine every sandbox also sees,
	// writable, at the same paths (tests share their scratch directory
	// this way); none by default.
	Share []string
	// Toolchains are directories of this machine every sandbox sees
	// read-only at the same paths, for toolchains installed under the
	// user's home (which sandboxes do not see otherwise); the runs put
	// each one's bin directory on PATH (ToolchainPath).
	Toolchains []string
	// HostUID and HostGID are the host user and group sandbox commands
	// run as when localcloud runs as root (so that a sandbox has no more
	// power over this machine's files than an unprivileged user); the
	// run's workspace and home are given to them. 65534 (nobody, nogroup)
	// when 0. Without root, sandboxes run as localcloud's user.
	HostUID int
	HostGID int
	// CgroupRoot is where cgroup v1 controllers are mounted;
	// /sys/fs/cgroup when empty.
	CgroupRoot string
}

// Defaults of the limits.
const (
	DefaultMemoryBytes = 4 << 30
	DefaultMaxProcs    = 1024
	// DefaultCPUShares halves a run's CPU weight against the machine's
	// other processes (1024 is a normal process group's).
	DefaultCPUShares = 512
	// DefaultDiskBytes and DefaultFileBytes bound a run's files in all
	// and one file it writes.
	DefaultDiskBytes      = 16 << 30
	DefaultFileBytes      = 4 << 30
	DefaultDiskCheckEvery = 5 * time.Second
	// DefaultInotifyInstances and DefaultInotifyWatches are a run's
	// inotify limits (watchers of tools like tsc, vite, jest fit).
	DefaultInotifyInstances = 32
	DefaultInotifyWatches   = 65536
	// DefaultHostUID is nobody's uid (and nogroup's gid) on Debian and
	// most distributions.
	DefaultHostUID = 65534
)

// Validate reports options that are not understood, with the fix.
func (o Options) Validate() error {
	switch o.Isolation {
	case "", IsolationNamespaces, IsolationNone:
	default:
		return fmt.Errorf("isolation %q is not known: use %q (the default) or %q", o.Isolation, IsolationNamespaces, IsolationNone)
	}
	switch o.Network {
	case "", NetworkInternet, NetworkLoopback, NetworkHost:
	default:
		return fmt.Errorf("network %q is not known: use %q (the default: the internet, not this machine), %q (loopback only) or %q (this machine's network)", o.Network, NetworkInternet, NetworkLoopback, NetworkHost)
	}
	for _, d := range o.Share {
		if !filepath.IsAbs(d) || filepath.Clean(d) != d {
			return fmt.Errorf("shared directory %q must be an absolute, clean path", d)
		}
	}
	for _, d := range o.Toolchains {
		if !filepath.IsAbs(d) || filepath.Clean(d) != d || d == "/" {
			return fmt.Errorf("toolchain directory %q must be an absolute, clean path below /", d)
		}
	}
	if o.HostUID < 0 || o.HostGID < 0 {
		return errors.New("the sandbox's host user and group must not be negative: use 0 for the default (65534, nobody)")
	}
	if o.MemoryBytes < 0 || o.MaxProcs < 0 || o.CPUShares < 0 || o.DiskBytes < 0 || o.FileBytes < 0 || o.DiskCheckEvery < 0 || o.InotifyInstances < 0 || o.InotifyWatches < 0 {
		return errors.New("resource limits must not be negative: use 0 for the defaults")
	}
	return nil
}

func (o Options) withDefaults() Options {
	if o.Isolation == "" {
		o.Isolation = IsolationNamespaces
	}
	if o.Network == "" {
		o.Network = NetworkInternet
	}
	if o.MemoryBytes == 0 {
		o.MemoryBytes = DefaultMemoryBytes
	}
	if o.MaxProcs == 0 {
		o.MaxProcs = DefaultMaxProcs
	}
	if o.CPUShares == 0 {
		o.CPUShares = DefaultCPUShares
	}
	if o.DiskBytes == 0 {
		o.DiskBytes = DefaultDiskBytes
	}
	if o.FileBytes == 0 {
		o.FileBytes = min(DefaultFileBytes, o.DiskBytes)
	}
	if o.DiskCheckEvery == 0 {
		o.DiskCheckEvery = DefaultDiskCheckEvery
	}
	if o.InotifyInstances == 0 {
		o.InotifyInstances = quarterOfHost("/proc/sys/fs/inotify/max_user_instances", DefaultInotifyInstances)
	}
	if o.InotifyWatches == 0 {
		o.InotifyWatches = quarterOfHost("/proc/sys/fs/inotify/max_user_watches", DefaultInotifyWatches)
	}
	if o.HostUID == 0 {
		o.HostUID = DefaultHostUID
	}
	if o.HostGID == 0 {
		o.HostGID = DefaultHostUID
	}
	if o.CgroupRoot == "" {
		o.CgroupRoot = "/sys/fs/cgroup"
	}
	return o
}

// quarterOfHost is def, or a quarter of the host's limit in file when
// that is less (a run never takes most of what the host user has).
func quarterOfHost(file string, def int) int {
	b, err := os.ReadFile(file)
	if err != nil {
		return def
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n/4 < 1 {
		return def
	}
	return min(def, n/4)
}

// Report says which protections are active, for status output.
type Report struct {
	// Isolation is the level in force: "namespaces" or "none".
	Isolation string `json:"isolation"`
	// Mechanism builds the namespaces ("bubblewrap").
	Mechanism string `json:"mechanism,omitempty"`
	// Protections in force, by name: user, mount, pid, uts, ipc, net
	// namespaces; "memory-limit", "process-limit", "cpu-share".
	Protections []string `json:"protections"`
	Network     string   `json:"network,omitempty"`
	// HostUID is the host user sandbox commands run as (localcloud's own
	// unless it is root; then an unprivileged one, and the protections
	// list "unprivileged-user").
	HostUID int `json:"host_uid"`
	// Shared are the machine's directories sandboxes also see.
	Shared []string `json:"shared,omitempty"`
	// Limits say how each limit is enforced: "cgroup-v1", "rlimit",
	// "userns" (inotify), "watchdog" (disk) or "none".
	Limits map[string]string `json:"limits,omitempty"`
	// Degraded lists what this machine could not provide, each with why.
	Degraded []string `json:"degraded,omitempty"`
}

// Summary is one line for humans.
func (r Report) Summary() string {
	if r.Isolation == IsolationNone {
		return "none: sandbox commands run as your user with your whole machine in reach"
	}
	s := fmt.Sprintf("%s (%s; network %s)", r.Isolation, strings.Join(r.Protections, ", "), r.Network)
	if len(r.Degraded) > 0 {
		s += "; degraded: " + strings.Join(r.Degraded, "; ")
	}
	return s
}

// ErrUnavailable is returned by New when the machine cannot isolate
// sandboxes and the configuration did not say isolation "none".
var ErrUnavailable = errors.New("this machine cannot isolate sandboxes")

// Spec describes one run's sandbox.
type Spec struct {
	// ID names the run (hostname and cgroup).
	ID string
	// Workspace and Home are the run's directories, bound writable at the
	// same paths.
	Workspace string
	Home      string
	// Logs is a directory of localcloud's (the managed processes' logs,
	// outside the workspace) the sandbox sees read-only at the same path;
	// none when empty.
	Logs string
	// Logger receives what goes wrong in the sandbox's machinery (its
	// spawner not starting); nil discards.
	Logger *slog.Logger
}

// BasePath is the sandbox's PATH before toolchains.
const BasePath = "/usr/local/bin:/usr/bin:/bin"

// SystemToolchains are the toolchain directories outside the usual PATH
// that installers put in system places (Go's tarball, Rust's images):
// each one that exists follows BasePath on a sandbox's PATH, as their
// install instructions append them.
var SystemToolchains = []string{"/usr/local/go/bin", "/usr/local/cargo/bin"}

// ToolchainPath is a sandbox's PATH: the bin directory of each of
// toolchains (the directory itself when it has none) first, then BasePath,
// then those of SystemToolchains that exist on this machine.
func ToolchainPath(toolchains []string) string {
	var dirs []string
	for _, d := range toolchains {
		if fi, err := os.Stat(filepath.Join(d, "bin")); err == nil && fi.IsDir() {
			d = filepath.Join(d, "bin")
		}
		dirs = append(dirs, d)
	}
	dirs = append(dirs, BasePath)
	for _, d := range SystemToolchains {
		if fi, err := os.Stat(d); err == nil && fi.IsDir() {
			dirs = append(dirs, d)
		}
	}
	return strings.Join(dirs, ":")
}

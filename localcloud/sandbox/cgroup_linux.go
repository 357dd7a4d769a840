//go:build linux

package sandbox

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// cgroups are the cgroup v1 hierarchies (pids, memory, cpu) in which this
// process may create child groups.
type cgroups struct {
	// base: controller -> <mount>/<own group>/sandboxd (v1), or
	// "unified" -> the delegated group the runs' groups are made in (v2).
	base map[string]string
	v2   bool
	seq  atomic.Int64
}

var cgroupControllers = []string{"pids", "memory", "cpu"}

// newCgroups finds, for each controller, this process's own group and
// checks that a child group can be made in it.
func newCgroups(root string) (*cgroups, error) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, fmt.Errorf("read /proc/self/cgroup: %w", err)
	}
	own := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 {
			continue
		}
		for _, c := range strings.Split(f[1], ",") {
			own[c] = f[2]
		}
	}
	if _, v1 := own["pids"]; !v1 {
		if path, ok := own[""]; ok {
			var fs unix.Statfs_t
			if err := unix.Statfs(root, &fs); err != nil || fs.Type != unix.CGROUP2_SUPER_MAGIC {
				return nil, fmt.Errorf("no cgroup v1 pids controller, and %s is not a cgroup2 mount", root)
			}
			return newCgroupsV2(root, path)
		}
	}
	cg := &cgroups{base: map[string]string{}}
	for _, c := range cgroupControllers {
		path, ok := own[c]
		if !ok {
			return nil, fmt.Errorf("no cgroup v1 %s controller", c)
		}
		base := filepath.Join(root, c, path, "sandboxd")
		if err := os.MkdirAll(base, 0o755); err != nil {
			return nil, fmt.Errorf("cgroup %s is not writable: %w", c, err)
		}
		if _, err := os.Stat(filepath.Join(base, "cgroup.procs")); err != nil {
			return nil, fmt.Errorf("cgroup %s: %s is not a cgroup: %w", c, base, err)
		}
		// base may exist already, made by another user (root): a group
		// made and removed here says this process can use it.
		probe := filepath.Join(base, fmt.Sprintf("probe-%d", os.Getpid()))
		if err := os.Mkdir(probe, 0o755); err != nil {
			return nil, fmt.Errorf("cgroup %s is not writable: %w", c, err)
		}
		_ = os.Remove(probe)
		cg.base[c] = base
	}
	return cg, nil
}

// removeLeftovers removes the run groups (and probe groups) left by
// localclouds that ended without removing them (SIGKILLed): those whose
// creator, named in the group's name, no longer runs. A group still
// holding processes cannot be removed; its processes are given a moment
// to leave (a killed creator's sandboxes die with it).
func (cg *cgroups) removeLeftovers() int {
	removed := map[string]bool{}
	for _, base := range cg.base {
		ents, err := os.ReadDir(base)
		if err != nil {
			continue
		}
		for _, e := range ents {
			pid := creatorPID(e.Name())
			if !e.IsDir() || pid <= 0 || pid == os.Getpid() || running(pid) {
				continue
			}
			d := filepath.Join(base, e.Name())
			for i := 0; i < 25; i++ {
				if err := os.Remove(d); err == nil || errors.Is(err, os.ErrNotExist) {
					removed[e.Name()] = true
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
	}
	return len(removed)
}

// creatorPID reads the pid in a group name made by create
// (<hostname>-<pid>-<seq>) or newCgroups (probe-<pid>); 0 if none.
func creatorPID(name string) int {
	if rest, ok := strings.CutPrefix(name, "probe-"); ok {
		pid, _ := strconv.Atoi(rest)
		return pid
	}
	if !strings.HasPrefix(name, "nook-") {
		return 0
	}
	f := strings.Split(name, "-")
	if len(f) < 3 {
		return 0
	}
	if _, err := strconv.Atoi(f[len(f)-1]); err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(f[len(f)-2])
	return pid
}

// running reports whether pid is a live process (a zombie is not).
func running(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && i+2 < len(s) {
		return s[i+2] != 'Z' && s[i+2] != 'X'
	}
	return true
}

// create makes one run's groups with opts' limits.
func (cg *cgroups) create(id string, opts Options) ([]string, error) {
	name := fmt.Sprintf("%s-%d-%d", hostname(id), os.Getpid(), cg.seq.Add(1))
	var dirs []string
	fail := func(err error) ([]string, error) {
		for _, d := range dirs {
			_ = os.Remove(d)
		}
		return nil, err
	}
	if cg.v2 {
		return cg.createV2(name, opts)
	}
	for _, c := range cgroupControllers {
		d := filepath.Join(cg.base[c], name)
		if err := os.Mkdir(d, 0o755); err != nil {
			return fail(fmt.Errorf("create the run's %s cgroup: %w", c, err))
		}
		dirs = append(dirs, d)
		var err error
		switch c {
		case "pids":
			err = write(d, "pids.max", strconv.Itoa(opts.MaxProcs))
		case "memory":
			err = write(d, "memory.limit_in_bytes", strconv.FormatInt(opts.MemoryBytes, 10))
			// Swap counts too, where the kernel accounts it.
			if e := write(d, "memory.memsw.limit_in_bytes", strconv.FormatInt(opts.MemoryBytes, 10)); e != nil && !errors.Is(e, os.ErrNotExist) {
				_ = e // not accounted: the memory limit alone holds
			}
		case "cpu":
			err = write(d, "cpu.shares", strconv.Itoa(opts.CPUShares))
		}
		if err != nil {
			return fail(fmt.Errorf("set the run's %s limit: %w", c, err))
		}
	}
	return dirs, nil
}

func write(dir, file, value string) error {
	return os.WriteFile(filepath.Join(dir, file), []byte(value), 0o644)
}

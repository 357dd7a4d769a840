//go:build linux

package sandbox

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// cgroup v2 (a unified hierarchy), where this process's own group is
// delegated to it (systemd's Delegate=yes): the runs' groups are made
// beside a leaf group this process moves into (a group with processes
// cannot pass controllers to its children), with memory.max, pids.max and
// cpu.weight; an OOM kill shows in memory.events.
//
// Not run on a real cgroup2 machine yet: tested against a fake hierarchy
// (TestCgroupV2), and New falls back to rlimits if its probe sandbox
// cannot use the groups.

// cgroupV2Leaf is the group this process moves into.
const cgroupV2Leaf = "localcloud"

// newCgroupsV2 prepares root/own (own from /proc/self/cgroup's "0::"
// line) for the runs' groups.
func newCgroupsV2(root, own string) (*cgroups, error) {
	base := filepath.Join(root, own)
	b, err := os.ReadFile(filepath.Join(base, "cgroup.controllers"))
	if err != nil {
		return nil, fmt.Errorf("cgroup v2: read the controllers of %s: %w", base, err)
	}
	have := strings.Fields(string(b))
	for _, c := range cgroupControllers {
		if !slices.Contains(have, c) {
			return nil, fmt.Errorf("cgroup v2: controller %s is not delegated to %s (systemd: Delegate=yes)", c, base)
		}
	}
	// The group's processes (this one, its children) move into a leaf,
	// unless it is the hierarchy's root, which may hold processes.
	if filepath.Clean(own) != "/" {
		procs, err := os.ReadFile(filepath.Join(base, "cgroup.procs"))
		if err != nil {
			return nil, fmt.Errorf("cgroup v2: %s is not writable: %w", base, err)
		}
		if len(strings.Fields(string(procs))) > 0 {
			leaf := filepath.Join(base, cgroupV2Leaf)
			if err := os.Mkdir(leaf, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
				return nil, fmt.Errorf("cgroup v2: %s is not writable: %w", base, err)
			}
			for _, pid := range strings.Fields(string(procs)) {
				if err := write(leaf, "cgroup.procs", pid); err != nil && pid == strconv.Itoa(os.Getpid()) {
					return nil, fmt.Errorf("cgroup v2: move this process into %s: %w", leaf, err)
				}
			}
		}
	}
	if err := write(base, "cgroup.subtree_control", "+memory +pids +cpu"); err != nil {
		return nil, fmt.Errorf("cgroup v2: enable the memory, pids and cpu controllers in %s: %w", base, err)
	}
	cg := &cgroups{base: map[string]string{"unified": base}, v2: true}
	// A group made and removed says this process can use it.
	probe := filepath.Join(base, fmt.Sprintf("probe-%d", os.Getpid()))
	if err := os.Mkdir(probe, 0o755); err != nil {
		return nil, fmt.Errorf("cgroup v2: %s is not writable: %w", base, err)
	}
	_ = os.Remove(probe)
	return cg, nil
}

// createV2 makes one run's group with opts' limits.
func (cg *cgroups) createV2(name string, opts Options) ([]string, error) {
	d := filepath.Join(cg.base["unified"], name)
	if err := os.Mkdir(d, 0o755); err != nil {
		return nil, fmt.Errorf("create the run's cgroup: %w", err)
	}
	err := write(d, "memory.max", strconv.FormatInt(opts.MemoryBytes, 10))
	if err == nil {
		err = write(d, "pids.max", strconv.Itoa(opts.MaxProcs))
	}
	if err == nil {
		err = write(d, "cpu.weight", strconv.Itoa(cpuWeight(opts.CPUShares)))
	}
	if err != nil {
		_ = os.Remove(d)
		return nil, fmt.Errorf("set the run's limits: %w", err)
	}
	// Swap would let a run go far over its memory: none, where the kernel
	// accounts it (the file is absent otherwise).
	_ = write(d, "memory.swap.max", "0")
	return []string{d}, nil
}

// cpuWeight converts cgroup v1 CPU shares (1024 a normal group's) to a
// v2 weight (100 a normal group's), within 1..10000.
func cpuWeight(shares int) int {
	return max(1, min(10000, shares*100/1024))
}

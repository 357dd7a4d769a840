//go:build linux

package sandbox

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestCgroupV2 runs the cgroup v2 logic against a fake hierarchy (this
// machine has cgroup v1; a real cgroup2 machine was not available): the
// delegated group's processes move into a leaf, the controllers are
// enabled for its children, a run's group gets memory.max, pids.max and
// cpu.weight, an oom_kill in memory.events is reported, and the groups of
// a creator that no longer runs are removed at the next start.
func TestCgroupV2(t *testing.T) {
	root := t.TempDir()
	own := "/system.slice/sandboxd.service"
	base := filepath.Join(root, own)
	if err := os.MkdirAll(base, 0o755); err != nil {
		t.Fatal(err)
	}
	put := func(dir, name, value string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(value), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	get := func(dir, name string) string {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(b))
	}
	self := strconv.Itoa(os.Getpid())
	put(base, "cgroup.controllers", "cpuset io memory pids\n")
	put(base, "cgroup.procs", self+"\n")
	if _, err := newCgroupsV2(root, own); err == nil || !strings.Contains(err.Error(), "cpu is not delegated") {
		t.Fatalf("without the cpu controller: %v, want an error naming it", err)
	}
	put(base, "cgroup.controllers", "cpuset cpu io memory pids\n")
	cg, err := newCgroupsV2(root, own)
	if err != nil {
		t.Fatal(err)
	}
	if got := get(filepath.Join(base, cgroupV2Leaf), "cgroup.procs"); got != self {
		t.Errorf("this process was not moved into the leaf: %q", got)
	}
	if got := get(base, "cgroup.subtree_control"); got != "+memory +pids +cpu" {
		t.Errorf("subtree_control = %q", got)
	}
	opts := Options{MemoryBytes: 64 << 20, MaxProcs: 64}.withDefaults()
	dirs, err := cg.create("run-1", opts)
	if err != nil {
		t.Fatal(err)
	}
	if len(dirs) != 1 || filepath.Dir(dirs[0]) != base {
		t.Fatalf("run groups %v, want one below %s", dirs, base)
	}
	for name, want := range map[string]string{"memory.max": strconv.Itoa(64 << 20), "pids.max": "64", "cpu.weight": "50", "memory.swap.max": "0"} {
		if got := get(dirs[0], name); got != want {
			t.Errorf("%s = %q, want %q", name, got, want)
		}
	}
	sb := &Sandbox{cgDirs: dirs}
	put(dirs[0], "memory.events", "low 0\nhigh 0\nmax 3\noom 1\noom_kill 0\n")
	if sb.OOMKilled() {
		t.Error("an OOM kill reported with oom_kill 0")
	}
	put(dirs[0], "memory.events", "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
	if !sb.OOMKilled() {
		t.Error("oom_kill 1 in memory.events is not reported")
	}
	// A group of a creator that ended, and this one's.
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"cgroup.procs", "memory.max", "memory.events", "pids.max", "cpu.weight", "memory.swap.max"} {
		os.Remove(filepath.Join(dirs[0], f)) // a fake group: rmdir needs it empty
	}
	left := filepath.Join(base, "nook-run-2-"+strconv.Itoa(dead.Process.Pid)+"-1")
	if err := os.Mkdir(left, 0o755); err != nil {
		t.Fatal(err)
	}
	if n := cg.removeLeftovers(); n != 1 {
		t.Errorf("removed %d leftovers, want 1", n)
	}
	if _, err := os.Stat(left); err == nil {
		t.Error("the dead creator's group is still there")
	}
	if _, err := os.Stat(dirs[0]); err != nil {
		t.Errorf("this process's own run group was removed: %v", err)
	}
}

func TestCPUWeight(t *testing.T) {
	for shares, want := range map[int]int{1024: 100, 512: 50, 2: 1, 1 << 20: 10000} {
		if got := cpuWeight(shares); got != want {
			t.Errorf("cpuWeight(%d) = %d, want %d", shares, got, want)
		}
	}
}

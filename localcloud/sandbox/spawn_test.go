//go:build linux

package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/internal/testutil"
	"github.com/sandboxd/sandboxd/localcloud/spawner"
)

// spawn runs script through the sandbox's spawner and returns its output
// (stdout and stderr) and end.
func spawn(t *testing.T, sb *Sandbox, script string, env ...string) (string, spawner.Exit, error) {
	t.Helper()
	p, r := start1(t, sb, script, env...)
	out, _ := io.ReadAll(r)
	r.Close()
	e, err := p.Wait()
	p.Close()
	return strings.TrimSpace(string(out)), e, err
}

// start1 starts script through the spawner; r reads its stdout and
// stderr. The spawner must take it.
func start1(t *testing.T, sb *Sandbox, script string, env ...string) (*spawner.Process, *os.File) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	in, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	p, err := sb.Spawn(context.Background(), spawner.Request{Argv: []string{"/bin/sh", "-c", script}, Env: append([]string{"PATH=/usr/bin:/bin"}, env...)}, [3]*os.File{in, w, w})
	in.Close()
	w.Close()
	if err != nil {
		r.Close()
		t.Fatalf("spawn %q: %v", script, err)
	}
	t.Cleanup(func() { p.Close() })
	return p, r
}

// confinement is what a command can tell of its own confinement.
const confinement = `grep -E '^(Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs|NSpid|Uid):' /proc/self/status
for ns in pid mnt net uts ipc user; do echo "ns $ns $(readlink /proc/self/ns/$ns)"; done
echo "cwd $(readlink /proc/self/cwd)"
echo "parent $(cat /proc/$PPID/comm 2>/dev/null || echo outside)"
echo "limits $(tr -s ' ' < /proc/self/limits | tr '\n' ';')"
echo "umask $(umask)"
sed 's/^/cgroup /' /proc/self/cgroup
env | grep -E '^(GREETING|SANDBOXD|GOMAXPROCS|GORACE)' | sed 's/^/env /'`

// A command the spawner starts is confined as one entering the sandbox
// is: no capabilities at all (effective, permitted, inheritable, bounding,
// ambient), no_new_privs, the sandbox's namespaces (its PID namespace one
// level below this one), its cgroups, its rlimits (not the open files Go
// raised for the spawner) and umask, the workspace as its directory, the
// sandbox's user, and the environment it was given, nothing of the
// spawner's.
func TestSpawnedCommandIsConfined(t *testing.T) {
	sb, ws := start(t, Options{})
	out, e, err := spawn(t, sb, confinement, "GREETING=hi there")
	if err != nil || e != (spawner.Exit{}) {
		t.Fatalf("%v %+v: %s", err, e, out)
	}
	chain, err := sh(t, sb, ws, confinement)
	if err != nil {
		t.Fatalf("through the entering chain: %v: %s", err, chain)
	}
	got := fields(out)
	caps := []string{"CapInh:", "CapPrm:", "CapEff:", "CapAmb:"}
	if os.Geteuid() == 0 {
		// Not as another user: setpriv, run as that user in the sandbox,
		// has no capability left to drop the bounding set with (neither
		// through the entering chain, compared below); with no capability
		// and no_new_privs no program can gain one.
		caps = append(caps, "CapBnd:")
	}
	for _, c := range caps {
		if got[c] != "0000000000000000" {
			t.Errorf("%s %q, want none", c, got[c])
		}
	}
	if got["NoNewPrivs:"] != "1" {
		t.Errorf("NoNewPrivs %q, want 1", got["NoNewPrivs:"])
	}
	// Seen from here, the command is one PID namespace down, with the pid
	// the spawner reported in it.
	p, r := start1(t, sb, "echo $$; exec sleep 307")
	line := make([]byte, 16)
	n, _ := r.Read(line)
	r.Close()
	if inner, _ := strconv.Atoi(strings.TrimSpace(string(line[:n]))); inner != p.Pid() || inner <= 0 {
		t.Errorf("the command says its pid is %q, the spawner said %d", line[:n], p.Pid())
	}
	found := false
	for deadline := time.Now().Add(10 * time.Second); !found && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		for _, pid := range inNamespace(t, sb, "sleep") { // once it executed sleep
			st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
			ns := fields(string(st))["NSpid:"]
			if f := strings.Fields(ns); len(f) >= 2 && f[0] == strconv.Itoa(pid) && f[len(f)-1] == strconv.Itoa(p.Pid()) {
				found = true
			}
		}
	}
	if !found {
		t.Errorf("no process of the sandbox's PID namespace has the spawned command's pid %d", p.Pid())
	}
	p.Close()
	for _, ns := range []string{"pid", "mnt", "net", "uts", "ipc", "user"} {
		want, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", sb.pid, ns))
		if err != nil {
			t.Fatal(err)
		}
		if got["ns "+ns] != want {
			t.Errorf("%s namespace %q, want the sandbox's %q", ns, got["ns "+ns], want)
		}
	}
	if got["cwd"] != ws {
		t.Errorf("directory %q, want the workspace %s", got["cwd"], ws)
	}
	if got["parent"] != "sandbox-spawner" {
		t.Errorf("parent %q: not started by the spawner", got["parent"])
	}
	if got["env GREETING"] != "hi there" || got["env SANDBOXD_SANDBOX_SPAWNER"] != "" || got["env GOMAXPROCS"] != "" || got["env GORACE"] != "" {
		t.Errorf("environment %v, want GREETING only", got)
	}
	for _, d := range sb.cgDirs {
		rel := strings.TrimPrefix(d, sb.p.opts.CgroupRoot+"/")
		_, path, _ := strings.Cut(rel, "/")
		if !strings.Contains(out, ":/"+path+"\n") && !strings.HasSuffix(out, ":/"+path) {
			t.Errorf("not in the sandbox's cgroup %s: %s", d, out)
		}
	}
	// The same as through the entering chain, but for who started it.
	want := fields(chain)
	for k, v := range want {
		if k != "parent" && k != "NSpid:" && !strings.HasPrefix(k, "env") && got[k] != v {
			t.Errorf("%s: spawned %q, through the chain %q", k, got[k], v)
		}
	}
}

// fields maps each line's first word (two for "ns", "env" and "cgroup"
// lines) to the rest.
func fields(out string) map[string]string {
	m := map[string]string{}
	for _, line := range strings.Split(out, "\n") {
		k, v, _ := strings.Cut(line, " ")
		if strings.HasPrefix(line, "Cap") || strings.HasPrefix(line, "NoNewPrivs") || strings.HasPrefix(line, "NSpid") || strings.HasPrefix(line, "Uid") {
			k, v, _ = strings.Cut(line, ":")
			k += ":"
		}
		if k == "ns" || k == "env" || k == "cgroup" {
			var k2 string
			sep := " "
			if k == "env" {
				sep = "="
			}
			if k == "cgroup" {
				sep = ":"
			}
			k2, v, _ = strings.Cut(v, sep)
			if k == "cgroup" {
				// hierarchy id:controllers:path
				c, p, _ := strings.Cut(v, ":")
				k2, v = k2+":"+c, p
			}
			k += " " + k2
		}
		m[k] = strings.TrimSpace(v)
	}
	return m
}

// A command through the spawner counts against the sandbox's process
// limit like any other: a fork bomb stops at it.
func TestSpawnedForkBombContained(t *testing.T) {
	sb, _ := start(t, Options{MaxProcs: 64})
	if sb.p.cg == nil {
		testutil.Unavailable(t, "no writable cgroups here: the process limit is an rlimit (see the report)", "run as root with cgroup v1, or a delegated cgroup v2")
	}
	out, _, err := spawn(t, sb, "n=0; while [ $n -lt 200 ]; do sleep 30 >/dev/null 2>&1 & n=$((n+1)); done 2>&1; echo started")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "fork") && !strings.Contains(out, "Resource temporarily unavailable") {
		t.Errorf("200 processes started under a limit of 64: %q", out)
	}
	b, err := os.ReadFile(filepath.Join(sb.cgDirs[0], "pids.current"))
	if err != nil {
		t.Fatal(err)
	}
	if n, _ := strconv.Atoi(strings.TrimSpace(string(b))); n > 64 {
		t.Errorf("pids.current = %d over the limit", n)
	}
}

// spawnerPIDs are the host pids of the sandbox's spawners.
func spawnerPIDs(t *testing.T, sb *Sandbox) []int {
	t.Helper()
	return inNamespace(t, sb, "sandbox-spawner")
}

// inNamespace are the host pids of the sandbox's processes named comm.
func inNamespace(t *testing.T, sb *Sandbox, comm string) []int {
	t.Helper()
	ns, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", sb.pid))
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		c, _ := os.ReadFile("/proc/" + e.Name() + "/comm")
		pidns, _ := os.Readlink("/proc/" + e.Name() + "/ns/pid")
		if pidns == ns && strings.TrimSpace(string(c)) == comm {
			pid, _ := strconv.Atoi(e.Name())
			pids = append(pids, pid)
		}
	}
	return pids
}

// One spawner serves every command; killed mid-run, the running
// command's caller hears of it (the command died with it), and the next
// command starts a new spawner.
func TestSpawnerKilledIsRestarted(t *testing.T) {
	sb, _ := start(t, Options{})
	for range 3 {
		if out, e, err := spawn(t, sb, "true"); err != nil || e != (spawner.Exit{}) {
			t.Fatalf("%v %+v %s", err, e, out)
		}
	}
	first := spawnerPIDs(t, sb)
	if len(first) != 1 {
		t.Fatalf("%d spawners for 3 commands, want 1", len(first))
	}
	p, r := start1(t, sb, "echo started; exec sleep 305")
	line := make([]byte, 8)
	if n, _ := r.Read(line); string(line[:n]) != "started\n" {
		t.Fatalf("the command did not start: %q", line[:n])
	}
	defer r.Close()
	if err := syscall.Kill(first[0], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Wait(); !errors.Is(err, spawner.ErrSpawnerEnded) {
		t.Fatalf("the command's caller got %v, want ErrSpawnerEnded", err)
	}
	if out, e, err := spawn(t, sb, "echo again"); err != nil || e != (spawner.Exit{}) || out != "again" {
		t.Fatalf("the next command: %v %+v %q", err, e, out)
	}
	if now := spawnerPIDs(t, sb); len(now) != 1 || now[0] == first[0] {
		t.Fatalf("spawners %v after %v was killed, want one new one", now, first)
	}
	// The killed one's command went with it.
	if out, _ := sh(t, sb, "", "pgrep -f 'sleep 30[5]' || echo none"); out != "none" {
		t.Fatalf("the command of the killed spawner still runs: %s", out)
	}
}

// A spawner that takes a command and does not answer (stopped) is killed,
// through the chain that started it (its parent-death signal), and the
// next command gets a new one.
func TestStuckSpawnerIsReplaced(t *testing.T) {
	sb, _ := start(t, Options{})
	if out, e, err := spawn(t, sb, "true"); err != nil || e != (spawner.Exit{}) {
		t.Fatalf("%v %+v %s", err, e, out)
	}
	stuck := spawnerPIDs(t, sb)
	if len(stuck) != 1 {
		t.Fatalf("spawners %v, want 1", stuck)
	}
	if err := syscall.Kill(stuck[0], syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(stuck[0], syscall.SIGKILL) })
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	in, _ := os.Open(os.DevNull)
	defer in.Close()
	if _, err := sb.Spawn(ctx, spawner.Request{Argv: []string{"/bin/true"}}, [3]*os.File{in, in, in}); !errors.Is(err, spawner.ErrNoAnswer) {
		t.Fatalf("Spawn on a stopped spawner: %v, want ErrNoAnswer", err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", stuck[0])); len(st) > 0 && !strings.Contains(string(st), ") Z"); st, _ = os.ReadFile(fmt.Sprintf("/proc/%d/stat", stuck[0])) {
		if time.Now().After(deadline) {
			t.Fatalf("the stuck spawner %d still runs: %s", stuck[0], st)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if out, e, err := spawn(t, sb, "echo again"); err != nil || e != (spawner.Exit{}) || out != "again" {
		t.Fatalf("the next command: %v %+v %q", err, e, out)
	}
}

// A spawner that cannot start: the command is refused with ErrUnavailable
// (the caller runs it through Command), which is logged once at Warn; no
// new start is tried for a while, then one is.
func TestSpawnerStartFailureFallsBack(t *testing.T) {
	sb, _ := start(t, Options{})
	var logs testutil.LockedBuffer
	sb.spec.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	tries := 0
	sb.spawner.launch = func(ctx context.Context, cmd *exec.Cmd) (*spawner.Client, error) {
		tries++
		return nil, errors.New("broken on purpose")
	}
	refused := func() {
		t.Helper()
		in, _ := os.Open(os.DevNull)
		_, err := sb.Spawn(context.Background(), spawner.Request{Argv: []string{"/bin/true"}}, [3]*os.File{in, in, in})
		in.Close()
		if !errors.Is(err, spawner.ErrUnavailable) {
			t.Fatalf("Spawn without a spawner: %v, want ErrUnavailable", err)
		}
	}
	for range 3 {
		refused()
	}
	if tries != 1 || strings.Count(logs.String(), "level=WARN") != 1 || !strings.Contains(logs.String(), "broken on purpose") {
		t.Fatalf("%d starts tried, logged %q; want 1 and one warning saying why", tries, logs.String())
	}
	// The retry time passed: tried again, failing again, not logged again.
	sb.spawner.mu.Lock()
	sb.spawner.retryAt = time.Time{}
	sb.spawner.mu.Unlock()
	refused()
	if tries != 2 || strings.Count(logs.String(), "level=WARN") != 1 {
		t.Fatalf("after the retry time: %d starts tried, logged %q; want 2 and still one warning", tries, logs.String())
	}
	// Commands still run, the old way.
	if out, err := sh(t, sb, "", "echo fallback"); err != nil || out != "fallback" {
		t.Fatalf("through the entering chain: %v %q", err, out)
	}
	sb.spawner.mu.Lock()
	sb.spawner.retryAt, sb.spawner.launch = time.Time{}, nil
	sb.spawner.mu.Unlock()
	if out, e, err := spawn(t, sb, "echo back"); err != nil || e != (spawner.Exit{}) || out != "back" {
		t.Fatalf("after the retry time: %v %+v %q", err, e, out)
	}
}

// Without isolation nothing is spawned: commands are plain processes.
func TestSpawnWithoutIsolation(t *testing.T) {
	sb, _ := start(t, Options{Isolation: IsolationNone})
	in, _ := os.Open(os.DevNull)
	defer in.Close()
	if _, err := sb.Spawn(context.Background(), spawner.Request{Argv: []string{"/bin/true"}}, [3]*os.File{in, in, in}); !errors.Is(err, spawner.ErrUnavailable) {
		t.Fatalf("Spawn without isolation: %v, want ErrUnavailable", err)
	}
}

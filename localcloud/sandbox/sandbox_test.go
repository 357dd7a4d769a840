//go:build linux

package sandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

// helperEnv makes the test binary, copied into a workspace, act as a
// program inside the sandbox: "listen:PORT", "alloc:BYTES", "inotify" or
// "inotifywatches:DIR".
const helperEnv = "SANDBOX_TEST_HELPER"

func TestMain(m *testing.M) {
	if h := os.Getenv(helperEnv); h != "" {
		os.Exit(helper(h))
	}
	os.Exit(m.Run())
}

func helper(h string) int {
	kind, arg, _ := strings.Cut(h, ":")
	switch kind {
	case "listen":
		ln, err := net.Listen("tcp", "127.0.0.1:"+arg)
		if err != nil {
			fmt.Println(err)
			return 1
		}
		fmt.Println("listening")
		c, err := ln.Accept()
		if err != nil {
			return 1
		}
		c.Write([]byte("inside\n"))
		c.Close()
		return 0
	case "inotify":
		// How many inotify instances can be had at once.
		n := 0
		for ; n < 10000; n++ {
			if _, err := unix.InotifyInit1(unix.IN_CLOEXEC); err != nil {
				break
			}
		}
		fmt.Printf("instances %d\n", n)
		return 0
	case "inotifywatches":
		// How many watches one instance can have (on directories of arg).
		fd, err := unix.InotifyInit1(unix.IN_CLOEXEC)
		if err != nil {
			fmt.Println(err)
			return 1
		}
		n := 0
		for ; n < 100000; n++ {
			d, err := os.MkdirTemp(arg, "w")
			if err != nil {
				fmt.Println(err)
				return 1
			}
			if _, err := unix.InotifyAddWatch(fd, d, unix.IN_CREATE); err != nil {
				break
			}
		}
		fmt.Printf("watches %d\n", n)
		return 0
	case "alloc":
		n, _ := strconv.Atoi(arg)
		b := make([]byte, n)
		for i := range b {
			b[i] = 1
		}
		fmt.Println(len(b))
		return 0
	}
	return 2
}

// helperIn copies the test binary into ws and returns the command that
// runs it there as helper h.
func helperIn(t *testing.T, ws string) string {
	t.Helper()
	src, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(ws, "helper"), src, 0o755); err != nil {
		t.Fatal(err)
	}
	return filepath.Join(ws, "helper")
}

func start(t *testing.T, opts Options) (*Sandbox, string) {
	t.Helper()
	ctx := context.Background()
	p, err := New(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	ws := filepath.Join(t.TempDir(), "workspace")
	if err := os.Mkdir(ws, 0o700); err != nil {
		t.Fatal(err)
	}
	sb, err := p.Start(ctx, Spec{ID: "run-" + strconv.Itoa(os.Getpid()), Workspace: ws})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Close() })
	return sb, ws
}

func sh(t *testing.T, sb *Sandbox, dir, script string) (string, error) {
	t.Helper()
	out, err := sb.Command(context.Background(), dir, "/bin/sh", "-c", script).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// The sandbox sees the system read-only, its workspace writable, and
// nothing of the rest of the machine: not this test's HOME, not a
// sibling directory of the workspace (another run's workspace), not /root.
func TestFilesystemConfined(t *testing.T) {
	home := t.TempDir()
	secret := filepath.Join(home, "secret")
	if err := os.WriteFile(secret, []byte("s3cret"), 0o600); err != nil {
		t.Fatal(err)
	}
	sb, ws := start(t, Options{})
	other := filepath.Join(filepath.Dir(ws), "other-run")
	if err := os.MkdirAll(other, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(other, "f"), []byte("other"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{secret, filepath.Join(other, "f")} {
		if out, err := sh(t, sb, ws, "cat "+p); err == nil {
			t.Errorf("the sandbox read %s: %q", p, out)
		}
	}
	if out, err := sh(t, sb, ws, "echo x > made && cat made && echo y > /tmp/t && cat /tmp/t"); err != nil || out != "x\ny" {
		t.Fatalf("writing the workspace and /tmp: %v: %q", err, out)
	}
	if b, err := os.ReadFile(filepath.Join(ws, "made")); err != nil || string(b) != "x\n" {
		t.Fatalf("the workspace write is not on the host: %v %q", err, b)
	}
	for _, p := range []string{"/usr/nook-escape", "/etc/nook-escape", "/nook-escape"} {
		if out, err := sh(t, sb, ws, "echo x > "+p); err == nil {
			t.Errorf("the sandbox wrote %s: %q", p, out)
		}
	}
	// Beside the workspace (here under /tmp, the sandbox's private one)
	// a write lands nowhere on the host.
	escape := filepath.Join(filepath.Dir(ws), "escape")
	_, _ = sh(t, sb, ws, "echo x > "+escape)
	if _, err := os.Stat(escape); err == nil {
		t.Errorf("%s was written on the host", escape)
	}
	if out, err := sh(t, sb, ws, "mount -o remount,rw /usr"); err == nil {
		t.Errorf("the sandbox remounted /usr writable: %q", out)
	}
}

// A sandbox of a root localcloud runs as an unprivileged host user: it
// cannot read /etc/shadow nor a root file of mode 0600 in a directory it
// sees (a shared one), while it reads that directory's other files, and
// what it writes in its workspace belongs to that user on the host.
func TestRootSandboxHasNoRootPower(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: without it the sandbox runs as this user")
	}
	share := t.TempDir()
	if err := os.Chmod(share, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, mode := range map[string]os.FileMode{"secret": 0o600, "public": 0o644} {
		if err := os.WriteFile(filepath.Join(share, name), []byte(name+"\n"), mode); err != nil {
			t.Fatal(err)
		}
	}
	sb, ws := start(t, Options{Share: []string{share}})
	if r := sb.p.Report(); r.HostUID != DefaultHostUID || !strings.Contains(strings.Join(r.Protections, ","), "unprivileged-user") {
		t.Errorf("report %+v, want host uid %d and the unprivileged-user protection", r, DefaultHostUID)
	}
	if out, err := sh(t, sb, ws, "cat "+filepath.Join(share, "public")); err != nil || out != "public" {
		t.Fatalf("the shared directory is not seen: %v %q", err, out)
	}
	for _, p := range []string{"/etc/shadow", filepath.Join(share, "secret")} {
		if out, err := sh(t, sb, ws, "cat "+p); err == nil {
			t.Errorf("the sandbox of a root localcloud read %s: %q", p, out)
		}
	}
	if out, err := sh(t, sb, ws, "echo x > made && mkdir -p d/e && echo y > d/e/f && echo ok"); err != nil || out != "ok" {
		t.Fatalf("writing the workspace: %v %q", err, out)
	}
	for _, p := range []string{"made", "d/e/f"} {
		fi, err := os.Stat(filepath.Join(ws, p))
		if err != nil {
			t.Fatal(err)
		}
		if uid := fi.Sys().(*syscall.Stat_t).Uid; uid != DefaultHostUID {
			t.Errorf("%s written by the sandbox belongs to uid %d on the host, want %d", p, uid, DefaultHostUID)
		}
	}
}

// The sandbox has its own PID namespace and hostname: a host process is
// neither visible nor signalable, a background process of one command is
// seen by the next, and Close kills them all.
func TestProcessesConfined(t *testing.T) {
	sb, ws := start(t, Options{})
	self := os.Getpid()
	if out, err := sh(t, sb, ws, "kill -0 "+strconv.Itoa(self)+" || ls /proc | grep -x "+strconv.Itoa(self)); err == nil {
		t.Errorf("the sandbox sees pid %d: %q", self, out)
	}
	if out, _ := sh(t, sb, ws, "hostname"); !strings.HasPrefix(out, "nook-") {
		t.Errorf("hostname = %q, want nook-...", out)
	}
	if _, err := sh(t, sb, ws, "setsid sleep 3171 > /dev/null 2>&1 < /dev/null & echo $! > pid"); err != nil {
		t.Fatal(err)
	}
	if out, err := sh(t, sb, ws, "kill -0 $(cat pid) && echo alive"); err != nil || out != "alive" {
		t.Fatalf("the next command does not see the background process: %v %q", err, out)
	}
	host := hostPIDs(t, "sleep 3171")
	if len(host) == 0 {
		t.Fatal("the background sleep is not found on the host")
	}
	sb.Close()
	deadline := time.Now().Add(10 * time.Second)
	for len(hostPIDs(t, "sleep 3171")) > 0 {
		if time.Now().After(deadline) {
			t.Fatal("the background process outlived the sandbox")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func hostPIDs(t *testing.T, cmdline string) []int {
	ents, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, _ := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if strings.ReplaceAll(strings.TrimRight(string(b), "\x00"), "\x00", " ") == cmdline {
			pids = append(pids, pid)
		}
	}
	return pids
}

// With the loopback network, a port on the host's loopback is out of
// reach, and DialTCP reaches a port the sandbox listens on.
func TestNetworkLoopbackOnly(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("host\n"))
			c.Close()
		}
	}()
	sb, ws := start(t, Options{Network: NetworkLoopback})
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	if out, err := sh(t, sb, ws, "bash -c 'exec 3<>/dev/tcp/127.0.0.1/"+port+" && echo connected'"); err == nil || strings.Contains(out, "connected") {
		t.Errorf("the sandbox reached the host's loopback port %s: %q", port, out)
	}
	// A listener inside, reached from here by DialTCP.
	// The same port number as the host's listener: the sandbox's own.
	cmd := sb.Command(context.Background(), ws, helperIn(t, ws))
	cmd.Env = []string{helperEnv + "=listen:" + port}
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	buf := make([]byte, 10)
	if n, _ := out.Read(buf); !strings.HasPrefix(string(buf[:n]), "listening") {
		t.Fatalf("the listener did not start: %q", buf[:n])
	}
	c, err := sb.DialTCP(context.Background(), "127.0.0.1:"+port)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	got := make([]byte, 16)
	n, _ := c.Read(got)
	if string(got[:n]) != "inside\n" {
		t.Fatalf("DialTCP reached %q, want the sandbox's listener", got[:n])
	}
}

// Through the dialer (the path of a localcloud that is not root, forced
// here): a port the sandbox listens on is reached, the host's listener on
// the same port is not, a closed port is an error, and the dialer comes
// back after it was killed.
func TestDialerReachesTheSandbox(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("host\n"))
			c.Close()
		}
	}()
	sb, ws := start(t, Options{})
	sb.p.viaDialer.Store(true)
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	bin := helperIn(t, ws)
	listen := func() *exec.Cmd {
		t.Helper()
		cmd := sb.Command(context.Background(), ws, bin)
		cmd.Env = []string{helperEnv + "=listen:" + port}
		out, _ := cmd.StdoutPipe()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		buf := make([]byte, 10)
		if n, _ := out.Read(buf); !strings.HasPrefix(string(buf[:n]), "listening") {
			t.Fatalf("the listener did not start: %q", buf[:n])
		}
		return cmd
	}
	read := func() string {
		t.Helper()
		c, err := sb.DialTCP(context.Background(), "127.0.0.1:"+port)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		got, _ := io.ReadAll(c)
		return string(got)
	}
	first := listen()
	if got := read(); got != "inside\n" {
		t.Fatalf("the dialer reached %q, want the sandbox's listener", got)
	}
	// The listener serves one connection and ends: then the port is closed.
	_ = first.Wait()
	if c, err := sb.DialTCP(context.Background(), "127.0.0.1:"+port); err == nil || !strings.Contains(err.Error(), "refused") {
		if c != nil {
			c.Close()
		}
		t.Fatalf("dialing a closed port in the sandbox: %v, want connection refused", err)
	}
	// Kill the dialer itself, in the sandbox's PID namespace.
	ns, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", sb.pid))
	killed := 0
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		env, _ := os.ReadFile("/proc/" + e.Name() + "/environ")
		pidns, _ := os.Readlink("/proc/" + e.Name() + "/ns/pid")
		if pidns == ns && strings.Contains(string(env), dialerEnv+"=1") {
			pid, _ := strconv.Atoi(e.Name())
			if syscall.Kill(pid, syscall.SIGKILL) == nil {
				killed++
			}
		}
	}
	if killed != 1 {
		t.Fatalf("killed %d dialers, want 1", killed)
	}
	sb.dialer.mu.Lock()
	done := sb.dialer.done
	sb.dialer.mu.Unlock()
	<-done
	listen()
	if got := read(); got != "inside\n" {
		t.Fatalf("after the dialer was killed: reached %q", got)
	}
}

// A fork bomb hits the run's process limit instead of the machine's.
func TestForkBombContained(t *testing.T) {
	sb, ws := start(t, Options{MaxProcs: 64})
	if sb.p.cg == nil {
		testutil.Unavailable(t, "no writable cgroups here: the process limit is an rlimit (see the report)", "run as root with cgroup v1, or a delegated cgroup v2")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// Bounded on purpose: 200 sleepers would be far over the limit.
	out, _ := sb.Command(ctx, ws, "/bin/sh", "-c", "n=0; while [ $n -lt 200 ]; do sleep 30 >/dev/null 2>&1 & n=$((n+1)); done 2>&1; echo started").CombinedOutput()
	if !strings.Contains(string(out), "fork") && !strings.Contains(string(out), "Resource temporarily unavailable") {
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

// A run over its memory limit is OOM-killed and reported so.
func TestMemoryLimit(t *testing.T) {
	sb, ws := start(t, Options{MemoryBytes: 64 << 20})
	if sb.p.cg == nil {
		testutil.Unavailable(t, "no writable cgroups here", "run as root with cgroup v1, or a delegated cgroup v2")
	}
	_, err := sh(t, sb, ws, helperEnv+"=alloc:"+strconv.Itoa(256<<20)+" "+helperIn(t, ws))
	if err == nil {
		t.Fatal("256 MiB allocated under a 64 MiB limit")
	}
	if !sb.OOMKilled() {
		t.Fatal("the OOM kill is not reported")
	}
}

func TestValidate(t *testing.T) {
	for _, o := range []Options{{Isolation: "full"}, {Network: "none"}, {MaxProcs: -1}} {
		if err := o.Validate(); err == nil {
			t.Errorf("%+v accepted", o)
		}
	}
}

// Without bubblewrap, New refuses unless isolation is configured none.
func TestRefusesWithoutNamespacesUnlessNone(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	_, err := New(context.Background(), Options{})
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "--isolation none") {
		t.Fatalf("New without bwrap: %v, want ErrUnavailable naming isolation none", err)
	}
	p, err := New(context.Background(), Options{Isolation: IsolationNone})
	if err != nil {
		t.Fatal(err)
	}
	if r := p.Report(); r.Isolation != IsolationNone || len(r.Degraded) == 0 {
		t.Fatalf("report %+v", r)
	}
}

// A run has its own inotify limits, which its commands cannot raise: it
// cannot take the instances and watches of the host user (what it uses
// is charged to that user too).
func TestInotifyLimitedPerRun(t *testing.T) {
	sb, ws := start(t, Options{InotifyInstances: 4, InotifyWatches: 50})
	if got := sb.p.report.Limits["inotify"]; got != "userns" {
		t.Fatalf("the report says inotify is limited by %q, want userns: %+v", got, sb.p.report)
	}
	out, err := sh(t, sb, ws, helperEnv+"=inotify "+helperIn(t, ws))
	if err != nil || out != "instances 4" {
		t.Fatalf("the sandbox made %q (%v), want 4 inotify instances", out, err)
	}
	// The host user still has its own.
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC)
	if err != nil {
		t.Fatalf("the host user has no inotify instance left: %v", err)
	}
	unix.Close(fd)
	for _, f := range []string{"max_inotify_instances", "max_inotify_watches"} {
		if out, err := sh(t, sb, ws, "echo 100000 > /proc/sys/user/"+f); err == nil {
			t.Errorf("the sandbox raised its %s: %s", f, out)
		}
		// Set in the namespace owning the sandbox's when there is one
		// (which bounds it): the sandbox's own then shows no limit.
		if out, _ := sh(t, sb, ws, "cat /proc/sys/user/"+f); sb.ownerNS == nil && out != map[string]string{"max_inotify_instances": "4", "max_inotify_watches": "50"}[f] {
			t.Errorf("%s in the sandbox: %q", f, out)
		}
	}
}

// Watches are counted too.
func TestInotifyWatchesLimitedPerRun(t *testing.T) {
	sb, ws := start(t, Options{InotifyInstances: 4, InotifyWatches: 50})
	dirs := filepath.Join(ws, "watched")
	if err := os.Mkdir(dirs, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dirs, 0o777); err != nil {
		t.Fatal(err)
	}
	out, err := sh(t, sb, ws, helperEnv+"=inotifywatches:"+dirs+" "+helperIn(t, ws))
	if err != nil || out != "watches 50" {
		t.Fatalf("the sandbox made %q (%v), want 50 watches", out, err)
	}
}

// One file a command writes is bounded.
func TestFileSizeLimited(t *testing.T) {
	sb, ws := start(t, Options{FileBytes: 1 << 20})
	if got := sb.p.report.Limits["file-size"]; got != "rlimit" {
		t.Fatalf("the report says the file size is limited by %q: %+v", got, sb.p.report)
	}
	out, err := sh(t, sb, ws, "head -c 3145728 /dev/zero > big")
	if err == nil {
		t.Errorf("writing 3 MiB under a 1 MiB file limit succeeded: %s", out)
	}
	fi, err := os.Stat(filepath.Join(ws, "big"))
	if err != nil || fi.Size() > 1<<20 {
		t.Fatalf("the file is %v (%v), want at most 1 MiB", fi.Size(), err)
	}
}

// The run's files are measured without following a link the sandbox
// planted: a link to a large tree elsewhere counts as the link.
func TestDiskUsageFollowsNoLink(t *testing.T) {
	sb, ws := start(t, Options{DiskBytes: 1 << 20, FileBytes: 8 << 20})
	big := t.TempDir()
	if err := os.WriteFile(filepath.Join(big, "big"), bytes.Repeat([]byte{1}, 4<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(big, filepath.Join(ws, "elsewhere")); err != nil {
		t.Fatal(err)
	}
	if used, _, over := sb.OverDiskLimit(); over || used > 1<<20 {
		t.Fatalf("%d bytes measured, over %v: the link was followed", used, over)
	}
	if _, err := sh(t, sb, ws, "head -c 2097152 /dev/zero > a"); err != nil {
		t.Fatal(err)
	}
	if used, limit, over := sb.OverDiskLimit(); !over || used < 2<<20 || limit != 1<<20 {
		t.Fatalf("%d bytes measured of %d, over %v: want over", used, limit, over)
	}
}

// nobody is the sandbox's host user of a root localcloud.
const nobody = DefaultHostUID

// Giving a run's tree to the sandbox's user changes what is in it, links
// included, and never what a link names.
func TestChownTreeFollowsNoLink(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to give files away")
	}
	outside := filepath.Join(t.TempDir(), "authorized_keys")
	if err := os.WriteFile(outside, []byte("key\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "a", "b"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "a", "b", "f"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, l := range []string{filepath.Join(dir, "link"), filepath.Join(dir, "a", "b", "link")} {
		if err := os.Symlink(outside, l); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(filepath.Dir(outside), filepath.Join(dir, "dirlink")); err != nil {
		t.Fatal(err)
	}
	if err := chownTree(dir, nobody, nobody); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{dir, filepath.Join(dir, "a", "b", "f"), filepath.Join(dir, "link"), filepath.Join(dir, "dirlink")} {
		var st syscall.Stat_t
		if err := syscall.Lstat(p, &st); err != nil || st.Uid != nobody {
			t.Errorf("%s: owner %d (%v), want %d", p, st.Uid, err, nobody)
		}
	}
	for _, p := range []string{outside, filepath.Dir(outside)} {
		var st syscall.Stat_t
		if err := syscall.Stat(p, &st); err != nil || st.Uid != 0 {
			t.Errorf("%s, named by a link in the tree, is owned by %d (%v)", p, st.Uid, err)
		}
	}
}

// TestMissingBubblewrapSaysHowToRunUnisolated: without bubblewrap, New
// fails saying which package to install and the exact flag and variable
// that run sandboxes unisolated.
func TestMissingBubblewrapSaysHowToRunUnisolated(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	_, err := New(context.Background(), Options{})
	if err == nil || !errors.Is(err, ErrUnavailable) {
		t.Fatalf("New without bubblewrap: %v", err)
	}
	for _, want := range []string{"apt install bubblewrap", "--isolation none", "SANDBOXD_LOCALCLOUD_ISOLATION=none"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not say %q: %v", want, err)
		}
	}
}

package agent

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

// directive sends a managed-process directive and decodes its record.
func directive(t *testing.T, c *ssh.Client, name string, req any) ProcessRecord {
	t.Helper()
	b, _ := json.Marshal(req)
	out, errOut, code := run(t, c, name+" "+string(b), "")
	if code != 0 {
		t.Fatalf("%s %s: exit %d, stderr %q", name, b, code, errOut)
	}
	var rec ProcessRecord
	if err := json.Unmarshal([]byte(strings.TrimSpace(out)), &rec); err != nil {
		t.Fatalf("%s: answer %q is not a record: %v", name, out, err)
	}
	return rec
}

type keyReq struct {
	Key string `json:"key"`
}

// gone reports whether pid no longer runs (reaped, or a zombie waiting for
// whoever inherited it).
func gone(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return true
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	return len(f) > 0 && f[0] == "Z"
}

func waitGone(t *testing.T, what string, pid int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !gone(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("%s (pid %d) still runs", what, pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func waitStatus(t *testing.T, c *ssh.Client, key, status string) ProcessRecord {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		rec := directive(t, c, DirectiveProcessStatus, keyReq{key})
		if rec.Status == status {
			return rec
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %s: status %q, want %q", key, rec.Status, status)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func waitFileContent(t *testing.T, path, want string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, _ := os.ReadFile(path)
		if strings.Contains(string(b), want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %q does not contain %q", path, b, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestProcessStartStatusLogsStopRestart(t *testing.T) {
	f := start(t)
	c := f.dial(t)
	rec := directive(t, c, DirectiveProcessStart, map[string]any{
		"key": "web", "command": "echo out-$RWX_SANDBOX; echo err >&2; pwd; exec sleep 60", "targetPort": 3100,
	})
	if rec.Key != "web" || rec.Status != ProcessRunning || rec.TargetPort != 3100 || rec.PID == 0 || rec.PGID != rec.PID || rec.StartedAt == "" {
		t.Fatalf("start record: %+v", rec)
	}
	if pgid, _ := syscall.Getpgid(rec.PID); pgid != rec.PID {
		t.Fatalf("process group %d, want its own (%d)", pgid, rec.PID)
	}
	logs := directive(t, c, DirectiveProcessLogs, keyReq{"web"})
	if logs.StdoutPath != rec.StdoutPath || logs.StderrPath != rec.StderrPath || logs.Status != ProcessRunning {
		t.Fatalf("logs record %+v, start record %+v", logs, rec)
	}
	// Outside the workspace: never synced back, and nothing the sandbox
	// planted there is followed.
	if within(logs.StdoutPath, f.dir) || within(logs.StderrPath, f.dir) {
		t.Fatalf("logs %s, %s are inside the workspace %s", logs.StdoutPath, logs.StderrPath, f.dir)
	}
	waitFileContent(t, rec.StdoutPath, "out-1\n"+f.dir+"\n")
	waitFileContent(t, rec.StderrPath, "err\n")

	// The CLI follows the logs with tail in the sandbox's shell: the paths
	// must be readable there.
	out, _, code := run(t, c, "cat "+rec.StdoutPath, "")
	if code != 0 || !strings.Contains(out, "out-1") {
		t.Fatalf("reading the log in the sandbox: exit %d, %q", code, out)
	}

	stopped := directive(t, c, DirectiveProcessStop, keyReq{"web"})
	if stopped.Status != ProcessStopped || stopped.Signal != "TERM" || stopped.CompletedAt == "" || stopped.ExitCode != nil {
		t.Fatalf("stop record: %+v", stopped)
	}
	waitGone(t, "stopped process", rec.PID)
	if st := directive(t, c, DirectiveProcessStatus, keyReq{"web"}); st.Status != ProcessStopped || st.PID != rec.PID {
		t.Fatalf("status after stop: %+v", st)
	}

	again := directive(t, c, DirectiveProcessRestart, keyReq{"web"})
	if again.Status != ProcessRunning || again.PID == rec.PID || again.TargetPort != 3100 {
		t.Fatalf("restart record: %+v (first %+v)", again, rec)
	}
	waitFileContent(t, again.StdoutPath, "out-1")
	// Start with a running key replaces the process.
	replaced := directive(t, c, DirectiveProcessStart, map[string]any{"key": "web", "command": "exec sleep 61"})
	waitGone(t, "replaced process", again.PID)
	if replaced.PID == again.PID || replaced.Status != ProcessRunning || replaced.TargetPort != 0 {
		t.Fatalf("replace record: %+v", replaced)
	}
	f.agent.Close()
	waitGone(t, "process at the agent's end", replaced.PID)
}

func TestProcessStatusAfterExit(t *testing.T) {
	f := start(t)
	c := f.dial(t)
	directive(t, c, DirectiveProcessStart, map[string]any{"key": "job", "command": "echo done; exit 3"})
	rec := waitStatus(t, c, "job", ProcessExited)
	if rec.ExitCode == nil || *rec.ExitCode != 3 || rec.Signal != "" || rec.CompletedAt == "" {
		t.Fatalf("exited record: %+v", rec)
	}
	// Kept across connections.
	c.Close()
	c2 := f.dial(t)
	if rec2 := directive(t, c2, DirectiveProcessStatus, keyReq{"job"}); rec2.Status != ProcessExited || *rec2.ExitCode != 3 {
		t.Fatalf("status on a new connection: %+v", rec2)
	}
	// Stopping an exited process answers its record.
	if rec3 := directive(t, c2, DirectiveProcessStop, keyReq{"job"}); rec3.Status != ProcessExited {
		t.Fatalf("stop of an exited process: %+v", rec3)
	}
}

func TestProcessOutlivesItsConnection(t *testing.T) {
	f := start(t)
	c := f.dial(t)
	rec := directive(t, c, DirectiveProcessStart, map[string]any{"key": "srv", "command": "exec sleep 60"})
	f.agent.DropConnections()
	c2 := f.dial(t)
	if st := directive(t, c2, DirectiveProcessStatus, keyReq{"srv"}); st.Status != ProcessRunning || gone(rec.PID) {
		t.Fatalf("after the connection dropped: %+v", st)
	}
}

func TestProcessStopKillsTheWholeGroup(t *testing.T) {
	f := start(t)
	c := f.dial(t)
	// A child that ignores TERM, in the process's group.
	rec := directive(t, c, DirectiveProcessStart, map[string]any{
		"key": "tree", "command": "(trap '' TERM; exec sleep 60) & echo $! > child.pid; sleep 60",
	})
	child := waitPID(t, filepath.Join(f.dir, "child.pid"))
	if pgid, _ := syscall.Getpgid(child); pgid != rec.PGID {
		t.Fatalf("child's group %d, want %d", pgid, rec.PGID)
	}
	directive(t, c, DirectiveProcessStop, keyReq{"tree"})
	waitGone(t, "leader", rec.PID)
	waitGone(t, "child that ignored TERM", child)
}

func TestProcessesEndWithTheRun(t *testing.T) {
	f := start(t)
	c := f.dial(t)
	rec := directive(t, c, DirectiveProcessStart, map[string]any{
		"key": "a", "command": "sleep 60 & echo $! > child.pid; exec sleep 60",
	})
	child := waitPID(t, filepath.Join(f.dir, "child.pid"))
	exited := directive(t, c, DirectiveProcessStart, map[string]any{
		"key": "b", "command": "sleep 60 & echo $! > orphan.pid", // leader exits, leaves a child in its group
	})
	orphan := waitPID(t, filepath.Join(f.dir, "orphan.pid"))
	waitStatus(t, c, "b", ProcessExited)
	closed := make(chan struct{})
	go func() { defer close(closed); f.agent.Close() }()
	defer func() { <-closed }()
	for name, pid := range map[string]int{"leader": rec.PID, "child": child, "exited leader's child": orphan, "exited leader": exited.PID} {
		waitGone(t, name, pid)
	}
}

func TestProcessDirectiveErrors(t *testing.T) {
	f := start(t)
	c := f.dial(t)
	for _, tc := range []struct{ command, want string }{
		{DirectiveProcessStatus + ` {"key":"nope"}`, `no background process named "nope"`},
		{DirectiveProcessStop + ` {"key":"nope"}`, `no background process named "nope"`},
		{DirectiveProcessRestart + ` {"key":"nope"}`, `no background process named "nope"`},
		{DirectiveProcessStart + ` not json`, "not JSON"},
		{DirectiveProcessStart + ` {"key":"a b","command":"true"}`, "only letters"},
		{DirectiveProcessStart + ` {"key":"x"}`, "no command"},
		{DirectiveProcessStatus, "not JSON"},
	} {
		out, errOut, code := run(t, c, tc.command, "")
		if code != 1 || out != "" || !strings.Contains(errOut, tc.want) {
			t.Errorf("%s: exit %d, stdout %q, stderr %q; want exit 1 and %q", tc.command, code, out, errOut, tc.want)
		}
	}
}

func TestDirectTCPIPReachesLoopbackOnly(t *testing.T) {
	f := start(t)
	c := f.dial(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { defer nc.Close(); _, _ = io.Copy(nc, nc) }()
		}
	}()
	port := ln.Addr().(*net.TCPAddr).Port
	for _, host := range []string{"127.0.0.1", "localhost"} {
		nc, err := c.Dial("tcp", net.JoinHostPort(host, fmt.Sprint(port)))
		if err != nil {
			t.Fatalf("forward to %s: %v", host, err)
		}
		if _, err := nc.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 4)
		if _, err := io.ReadFull(nc, buf); err != nil || string(buf) != "ping" {
			t.Fatalf("echo through the forward: %q, %v", buf, err)
		}
		nc.Close()
	}
	for _, addr := range []string{"192.0.2.1:80", "[2001:db8::1]:80", "example.com:80"} {
		_, err := c.Dial("tcp", addr)
		var oc *ssh.OpenChannelError
		if err == nil || !strings.Contains(err.Error(), "loopback") {
			t.Errorf("forward to %s: %v, want a refusal naming the loopback", addr, err)
		} else if ok := asOpenChannelError(err, &oc); ok && oc.Reason != ssh.Prohibited {
			t.Errorf("forward to %s refused with %v, want prohibited", addr, oc.Reason)
		}
	}
	// A closed loopback port is a connection failure, not a hang.
	closedAddr := testutil.ClosedAddr(t)
	if _, err := c.Dial("tcp", closedAddr); err == nil || !strings.Contains(err.Error(), "connect to") {
		t.Errorf("forward to a closed port: %v", err)
	}
}

func asOpenChannelError(err error, target **ssh.OpenChannelError) bool {
	oc, ok := err.(*ssh.OpenChannelError)
	if ok {
		*target = oc
	}
	return ok
}

// snapshot is a file's content and mode, or that it does not exist.
func snapshot(t *testing.T, path string) string {
	t.Helper()
	fi, err := os.Lstat(path)
	if err != nil {
		return err.Error()
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	return fmt.Sprintf("%v %q", fi.Mode(), b)
}

// TestProcessLogsNeverFollowALinkPlantedInTheWorkspace: a command links
// the place where the logs of a background process used to be (the
// workspace's .git/sandbox-processes) to a file outside the sandbox; the
// next start and restart of that process leave the file as it was.
func TestProcessLogsNeverFollowALinkPlantedInTheWorkspace(t *testing.T) {
	victim := filepath.Join(t.TempDir(), "bashrc")
	if err := os.WriteFile(victim, []byte("keep me\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, victim)
	f := start(t)
	c := f.dial(t)
	plant := "mkdir -p .git/sandbox-processes && for s in stdout stderr; do ln -sf " + victim + " .git/sandbox-processes/web.$s.log; done"
	if _, errOut, code := run(t, c, plant, ""); code != 0 {
		t.Fatalf("planting the links: exit %d: %s", code, errOut)
	}
	rec := directive(t, c, DirectiveProcessStart, map[string]any{"key": "web", "command": "echo pwned; echo pwned >&2; exec sleep 60"})
	waitFileContent(t, rec.StdoutPath, "pwned")
	directive(t, c, DirectiveProcessRestart, keyReq{"web"})
	waitFileContent(t, rec.StdoutPath, "pwned")
	directive(t, c, DirectiveProcessStop, keyReq{"web"})
	if after := snapshot(t, victim); after != before {
		t.Fatalf("the file the planted link names changed: %s, was %s", after, before)
	}
}

// TestProcessLogDirectoryInsideTheWorkspaceIsRefused: an agent is never
// configured to open the logs where the sandbox writes.
func TestProcessLogDirectoryInsideTheWorkspaceIsRefused(t *testing.T) {
	ws := t.TempDir()
	_, err := Start(Config{HostKey: newSigner(t), AuthorizedKey: newSigner(t).PublicKey(), Workspace: ws, ProcessDir: filepath.Join(ws, ".git", "sandbox-processes")})
	if err == nil || !strings.Contains(err.Error(), "inside the workspace") {
		t.Fatalf("Start with the logs in the workspace: %v, want a refusal", err)
	}
}

// leadsSession is a command that prints "yes" when its shell leads its
// own session (so it has no controlling terminal it did not open).
const leadsSession = `set -- $(sed 's/^.*) //' /proc/$$/stat); if [ "$4" = "$$" ] && [ "$5" = 0 ]; then echo yes; else echo "no: pid $$ session $4 tty $5"; fi`

// TestCommandsLeadTheirOwnSession: an exec'd command and a background
// process each lead a new session without a controlling terminal, never
// the agent's.
func TestCommandsLeadTheirOwnSession(t *testing.T) {
	f := start(t)
	c := f.dial(t)
	if out, errOut, code := run(t, c, "exec sh -c '"+strings.ReplaceAll(leadsSession, "'", `'\''`)+"'", ""); code != 0 || strings.TrimSpace(out) != "yes" {
		t.Errorf("exec: %q %q (exit %d)", out, errOut, code)
	}
	rec := directive(t, c, DirectiveProcessStart, map[string]any{"key": "sid", "command": "exec sh -c '" + strings.ReplaceAll(leadsSession, "'", `'\''`) + "'"})
	waitFileContent(t, rec.StdoutPath, "\n")
	if b, _ := os.ReadFile(rec.StdoutPath); strings.TrimSpace(string(b)) != "yes" {
		t.Errorf("background process: %q", b)
	}
}

package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"
)

// sshTo opens an SSH connection to run's agent as another client would
// (the RWX CLI on another machine), with the credentials the runs API hands
// out.
func (lc *localcloud) sshTo(t testing.TB, run string) *ssh.Client {
	t.Helper()
	var ci struct {
		Address        string `json:"address"`
		PublicHostKey  string `json:"public_host_key"`
		PrivateUserKey string `json:"private_user_key"`
	}
	if err := json.Unmarshal(lc.call(t, "GET", "/mint/api/sandbox_connection_info?sandbox_key="+run, nil), &ci); err != nil {
		t.Fatal(err)
	}
	hostKey, _, _, _, err := ssh.ParseAuthorizedKey([]byte(ci.PublicHostKey))
	if err != nil {
		t.Fatal(err)
	}
	signer, err := ssh.ParsePrivateKey([]byte(ci.PrivateUserKey))
	if err != nil {
		t.Fatal(err)
	}
	c, err := ssh.Dial("tcp", ci.Address, &ssh.ClientConfig{User: "rwx-cli", Auth: []ssh.AuthMethod{ssh.PublicKeys(signer)}, HostKeyCallback: ssh.FixedHostKey(hostKey), Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// execRequests is how many exec requests run's agent has received.
func (lc *localcloud) execRequests(t testing.TB, run string) int64 {
	t.Helper()
	var st struct {
		ExecRequests int64 `json:"exec_requests"`
	}
	if err := json.Unmarshal(lc.call(t, "GET", "/admin/runs/"+run+"/ssh-stats", nil), &st); err != nil {
		t.Fatal(err)
	}
	return st.ExecRequests
}

// bgNook is an nook running in the background.
type bgNook struct {
	cmd  *exec.Cmd
	out  *strings.Builder
	errb *strings.Builder
	done chan result
}

func (e *env) nookBackground(dir string, args ...string) *bgNook {
	e.t.Helper()
	b := &bgNook{cmd: e.nookCmd(dir, args...), out: &strings.Builder{}, errb: &strings.Builder{}, done: make(chan result, 1)}
	b.cmd.Stdout, b.cmd.Stderr = b.out, b.errb
	if err := b.cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	go func() {
		err := b.cmd.Wait()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			code = -1
		}
		b.done <- result{code: code, stdout: b.out.String(), stderr: b.errb.String()}
	}()
	e.t.Cleanup(func() { b.cmd.Process.Kill() })
	return b
}

// wait returns nook's result, failing the test if it takes longer than
// timeout (a client waiting forever is a bug).
func (b *bgNook) wait(t testing.TB, timeout time.Duration) result {
	t.Helper()
	select {
	case r := <-b.done:
		return r
	case <-time.After(timeout):
		b.cmd.Process.Kill()
		t.Fatalf("nook %v still waiting after %s", b.cmd.Args[1:], timeout)
		return result{}
	}
}

// counterFile is a file outside the sandbox's checkout that its commands
// append a line to, so the test can count how often a command ran.
func counterFile(t testing.TB, name string) string {
	t.Helper()
	f := filepath.Join(markerDir, fmt.Sprintf("nook-e2e-%s-%d-%d", name, os.Getpid(), time.Now().UnixNano()))
	t.Cleanup(func() { os.Remove(f) })
	return f
}

func lines(t testing.TB, path string) int {
	t.Helper()
	b, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return 0
	}
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(b), "\n")
}

// TestLockRetriedWhenTheConnectionDropsWhileWaiting: another client holds
// the sandbox's lock; the daemon's lock request waits; the SSH connections
// drop (the other client's too, which frees the lock). The daemon takes the
// lock again on a new connection and the command runs exactly once.
func TestLockRetriedWhenTheConnectionDropsWhileWaiting(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	e.startDaemon()
	repo := e.newRepo("lockretry", defaultConfig)
	run := e.startSandbox(repo)
	e.mustNook(repo, "exec", "--no-sync", "--", "true") // the daemon's connection is up

	holder, err := lc.sshTo(t, run).NewSession()
	if err != nil {
		t.Fatal(err)
	}
	if err := holder.Run("__rwx_sandbox_lock_requested__"); err != nil {
		t.Fatalf("the other client could not take the lock: %v", err)
	}
	counter := counterFile(t, "lockretry")
	before := lc.execRequests(t, run)
	b := e.nookBackground(repo, "exec", "--no-sync", "--", "sh", "-c", "echo ran >> "+counter)
	waitUntil(t, 20*time.Second, "the daemon's lock request to reach the agent", func() bool {
		return lc.execRequests(t, run) > before
	})
	if n := lines(t, counter); n != 0 {
		t.Fatalf("the command ran (%d times) while another client held the lock", n)
	}
	lc.call(t, "POST", "/admin/runs/"+run+"/drop-connections", nil)
	r := b.wait(t, 60*time.Second)
	if r.code != 0 {
		t.Fatalf("exec after the connection dropped during the lock wait: %s", r)
	}
	if n := lines(t, counter); n != 1 {
		t.Fatalf("the command ran %d times, want once", n)
	}
}

// TestConnectionLostMidCommandIsReportedNeverRerun: the SSH connection
// drops while the command runs. nook ends with 125 and says the command may
// have run and was not run again; the command is not run a second time,
// its remote process is ended, and the next exec works.
func TestConnectionLostMidCommandIsReportedNeverRerun(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	// The unheld path: a held command survives the drop (durable_default_test.go).
	e.writeConfig(map[string]any{"durable_exec": false})
	e.startDaemon()
	repo := e.newRepo("midcmd", defaultConfig)
	run := e.startSandbox(repo)
	counter := counterFile(t, "midcmd")
	marker := fmt.Sprintf("%d.%d", 600+os.Getpid()%300, time.Now().UnixNano()%1000) // a unique sleep argument
	b := e.nookBackground(repo, "exec", "--no-sync", "--", "sh", "-c", "echo ran >> "+counter+"; exec sleep "+marker)
	waitUntil(t, 30*time.Second, "the command to start", func() bool { return lines(t, counter) == 1 })
	lc.call(t, "POST", "/admin/runs/"+run+"/drop-connections", nil)
	r := b.wait(t, 60*time.Second)
	checkLostCommandReport(t, r)
	e.mustNook(repo, "exec", "--no-sync", "--", "true")
	if n := lines(t, counter); n != 1 {
		t.Fatalf("the command ran %d times, want once", n)
	}
	waitUntil(t, 20*time.Second, "the dropped command's process to end", func() bool { return !processWithArg(marker) })
}

// checkLostCommandReport checks how nook reports a command whose connection
// broke while it ran.
func checkLostCommandReport(t testing.TB, r result) {
	t.Helper()
	if r.code != 125 {
		t.Fatalf("a command whose connection dropped: want exit 125, got %s", r)
	}
	for _, want := range []string{"may or may not have", "not run again"} {
		if !strings.Contains(r.stderr, want) {
			t.Fatalf("the report of a lost command does not say %q: %s", want, r.stderr)
		}
	}
}

// processWithArg reports whether a process on this machine has arg as one
// of its arguments.
func processWithArg(arg string) bool {
	dirs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, d := range dirs {
		b, err := os.ReadFile(d)
		if err != nil {
			continue
		}
		for _, a := range strings.Split(string(b), "\x00") {
			if a == arg {
				return true
			}
		}
	}
	return false
}

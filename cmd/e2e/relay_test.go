package e2e

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// relayPIDs lists the `hold relay` processes of run (their working
// directory is its workspace).
func relayPIDs(t testing.TB, run string) []int {
	t.Helper()
	return holdPIDs(run, "relay")
}

// holdPIDs lists the `hold VERB` processes of run.
func holdPIDs(run, verb string) []int { return helperPIDs(run, "hold", verb) }

// helperPIDs lists the sandbox helper processes of run (their working
// directory is its workspace) whose arguments begin with args.
func helperPIDs(run string, args ...string) []int {
	var pids []int
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, "cmdline"))
		if err != nil {
			continue
		}
		argv := strings.Split(strings.TrimSuffix(string(b), "\x00"), "\x00")
		if len(argv) <= len(args) || !slices.Equal(argv[1:1+len(args)], args) {
			continue
		}
		if cwd, err := os.Readlink(filepath.Join(d, "cwd")); err != nil || !strings.Contains(cwd, run) {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(d))
		pids = append(pids, pid)
	}
	slices.Sort(pids)
	return pids
}

// checkReattached checks an exec whose command (`echo start; echo ran >>
// counter; ...; echo end; echo late >&2; exit want`) lost what relayed it:
// its own exit code, all its output, a warning that says so (saying),
// and one run.
func checkReattached(t *testing.T, d *daemon, what string, r result, want int, saying, counter string) {
	t.Helper()
	if r.code != want || r.stdout != "start\nend\n" || !strings.HasSuffix(r.stderr, "late\n") {
		d.stop(t)
		t.Fatalf("%s: exit %d, stdout %q, stderr %q; want exit %d, start and end, late\n%s", what, r.code, r.stdout, r.stderr, want, d.logs)
	}
	if !strings.Contains(r.stderr, saying) {
		t.Errorf("%s: stderr %q does not say %q", what, r.stderr, saying)
	}
	if n := strings.Count(readFileOr(counter), "ran"); n != 1 {
		t.Errorf("%s: the command ran %d times, want once", what, n)
	}
}

// newestHelperPID is the helper process of run whose arguments begin
// with args that started last (an earlier exec's may still be exiting:
// its exec returned at the exchange's end), 0 when there is none.
func newestHelperPID(run string, args ...string) int {
	newest, at := 0, int64(-1)
	for _, pid := range helperPIDs(run, args...) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		// The fields after the command's name, which may hold spaces:
		// starttime is the 22nd field, the 20th after ")".
		f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		if len(f) < 20 {
			continue
		}
		// Ties (one clock tick): the later pid.
		if t, err := strconv.ParseInt(f[19], 10, 64); err == nil && t >= at {
			newest, at = pid, t
		}
	}
	return newest
}

// killMidCommand runs nook with args in repo until its stdout has
// "start", calls kill with nook's process, and waits up to a minute for
// nook's end: its exit code and output.
func (e *env) killMidCommand(t *testing.T, d *daemon, repo string, args []string, kill func(nook *os.Process)) (code int, stdout, stderr string) {
	t.Helper()
	c := e.nookCmd(repo, args...)
	out, errb := &syncBuf{}, &syncBuf{}
	c.Stdout, c.Stderr = out, errb
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Wait() }()
	t.Cleanup(func() { _ = c.Process.Kill() })
	if !waitFor(30*time.Second, func() bool { return strings.Contains(out.String(), "start") }) {
		d.stop(t) // its logs are read once it ended
		t.Fatalf("the command did not start: stdout %q, stderr %q\n%s", out, errb, d.logs)
	}
	kill(c.Process)
	var err error
	select {
	case err = <-done:
	case <-time.After(60 * time.Second):
		d.stop(t)
		t.Fatalf("the exec did not end within a minute of the kill: stdout %q, stderr %q\n%s", out, errb, d.logs)
	}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case asExit(err, &ee):
		code = ee.ExitCode()
	default:
		t.Fatalf("run nook: %v", err)
	}
	return code, out.String(), errb.String()
}

// heldInMemory lists what the holder keeps in the memory root
// (/dev/shm/sandboxd-UID/hold) of the sandbox of process pid.
func heldInMemory(t testing.TB, pid int) []string {
	t.Helper()
	dirs, _ := filepath.Glob(fmt.Sprintf("/proc/%d/root/dev/shm/sandboxd-*/hold", pid))
	if len(dirs) != 1 {
		t.Fatalf("holder roots in the sandbox's /dev/shm: %v, want one", dirs)
	}
	entries, err := os.ReadDir(dirs[0])
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, e := range entries {
		ids = append(ids, e.Name())
	}
	return ids
}

// relaySandbox starts a daemon and a served sandbox of a new repository
// name whose relay is up, after one held exec: the daemon, the
// repository, the run and the relay's pid.
func (e *env) relaySandbox(t *testing.T, name string) (d *daemon, repo, run string, relay int) {
	t.Helper()
	d = e.startDaemon()
	repo = e.newRepo(name, defaultConfig)
	run = e.startServedSandbox(t, repo)
	e.mustNook(repo, "exec", "--no-sync", "--", "true")
	return d, repo, run, waitOneRelay(t, run)
}

// waitOneRelay waits for run to have exactly one relay process and
// returns its pid.
func waitOneRelay(t testing.TB, run string) int {
	t.Helper()
	var pids []int
	if !waitFor(10*time.Second, func() bool { pids = relayPIDs(t, run); return len(pids) == 1 }) {
		t.Fatalf("run %s has relay processes %v, want exactly one", run, pids)
	}
	return pids[0]
}

// watchPIDs looks at list every 20 ms until stop is closed, then sends
// how many processes it saw.
func watchPIDs(list func() []int) (stop chan struct{}, seen <-chan int) {
	stop = make(chan struct{})
	n := make(chan int, 1)
	go func() {
		pids := map[int]bool{}
		defer func() { n <- len(pids) }()
		for {
			for _, pid := range list() {
				pids[pid] = true
			}
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	return stop, n
}

// TestHeldExecsInARowShareOneRelayProcess: no-sync execs without a
// terminal (held) one after another on one sandbox all go through one
// `hold relay` process on the kept connection, costing no exec request
// of their own; each one's stdout, stderr, stdin and exit code are
// exactly the command's, and Ctrl-C reaches the command.
func TestHeldExecsInARowShareOneRelayProcess(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	d := e.startDaemon()
	repo := e.newRepo("relayrow", defaultConfig)
	run := e.startServedSandbox(t, repo)
	e.mustNook(repo, "exec", "--no-sync", "--", "true")
	relay := waitOneRelay(t, run)
	// A `hold start` lives as long as its command: one of any exec is
	// seen by a look every 20 ms at commands that last 200 ms.
	stop, starts := watchPIDs(func() []int { return holdPIDs(run, "start") })
	before := lc.execRequests(t, run)
	const n = 8
	for i := 0; i < n; i++ {
		in := fmt.Sprintf("line %d\nand more\n", i)
		r := e.nookIn(repo, strings.NewReader(in), "exec", "--no-sync", "--", "sh", "-c", fmt.Sprintf("cat; sleep 0.2; echo err%d >&2; exit %d", i, i))
		if r.code != i || r.stdout != in || r.stderr != fmt.Sprintf("err%d\n", i) {
			close(stop)
			t.Fatalf("held exec %d through the relay: %s; want exit %d, stdout %q, stderr %q", i, r, i, in, fmt.Sprintf("err%d\n", i))
		}
	}
	close(stop)
	used := lc.execRequests(t, run) - before
	t.Logf("%d held execs took %d exec requests", n, used)
	if k := <-starts; k > 0 {
		t.Errorf("%d held execs started %d `hold start` processes (%d exec requests), want none: they did not go through the relay", n, k, used)
	}
	if pids := relayPIDs(t, run); !slices.Equal(pids, []int{relay}) {
		t.Errorf("relay processes after %d execs: %v, want the first one only (%d)", n, pids, relay)
	}
	// The holder keeps its execs in the sandbox's memory, and each
	// request has it forget the execs whose end the daemon read.
	if kept := heldInMemory(t, relay); len(kept) == 0 || len(kept) > 2 {
		t.Errorf("after %d execs the holder keeps %v in the sandbox's /dev/shm, want the last one or two", n, kept)
	}

	// Ctrl-C reaches the command run by the relay.
	code, out, errb := e.killMidCommand(t, d, repo, []string{"exec", "--no-sync", "--", "sh", "-c", `trap 'echo got INT; exit 9' INT; echo start; while :; do sleep 0.1; done`}, func(nook *os.Process) {
		if err := nook.Signal(syscall.SIGINT); err != nil {
			t.Fatal(err)
		}
	})
	if code != 9 || out != "start\ngot INT\n" {
		t.Errorf("Ctrl-C through the relay: exit %d, stdout %q, stderr %q; want exit 9 from the command's trap", code, out, errb)
	}
	if pids := relayPIDs(t, run); !slices.Equal(pids, []int{relay}) {
		t.Errorf("relay processes after a signal: %v, want the first one only (%d)", pids, relay)
	}
}

// TestSyncedExecsInARowRunInTheRelay: once the relay serves, synced
// execs one after another run their exchange (push, command, pull) in
// the relay's process: no exec request and no helper process of their
// own. Each one's stdout, stderr, stdin, exit code and edits are exactly
// the command's, a local edit reaches it, and Ctrl-C reaches it.
func TestSyncedExecsInARowRunInTheRelay(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	d := e.startDaemon()
	repo := e.newRepo("relaysync", defaultConfig)
	run := e.startServedSandbox(t, repo)
	e.mustNook(repo, "exec", "--", "true")
	e.mustNook(repo, "exec", "--", "true")
	relay := waitOneRelay(t, run)
	// The helper of the exchange that opened the relay may still be
	// exiting (its exec returned at the exchange's end).
	waitUntil(t, 10*time.Second, "no exchange helper", func() bool { return len(helperPIDs(run, "exchange")) == 0 })
	// An exchange helper lives as long as its command: one of any exec
	// is seen by a look every 20 ms at commands that last 200 ms.
	stop, helpers := watchPIDs(func() []int { return helperPIDs(run, "exchange") })
	before := lc.execRequests(t, run)
	const n = 6
	for i := 0; i < n; i++ {
		writeFile(t, filepath.Join(repo, "local.txt"), fmt.Sprintf("local %d\n", i))
		in := fmt.Sprintf("line %d\n", i)
		r := e.nookIn(repo, strings.NewReader(in), "exec", "--", "sh", "-c", fmt.Sprintf("cat; cat local.txt; sleep 0.2; echo made%d > made.txt; echo err%d >&2; exit %d", i, i, i))
		want := in + fmt.Sprintf("local %d\n", i)
		if r.code != i || r.stdout != want || r.stderr != fmt.Sprintf("err%d\n", i) {
			close(stop)
			t.Fatalf("synced exec %d through the relay: %s; want exit %d, stdout %q, stderr %q", i, r, i, want, fmt.Sprintf("err%d\n", i))
		}
		if got := readFile(t, filepath.Join(repo, "made.txt")); got != fmt.Sprintf("made%d\n", i) {
			close(stop)
			t.Fatalf("synced exec %d: its edit came back as %q", i, got)
		}
	}
	close(stop)
	used := lc.execRequests(t, run) - before
	// (The lease's yield after a burst of 2 s makes two: a release and a
	// take.)
	t.Logf("%d synced execs took %d exec requests", n, used)
	if k := <-helpers; k > 0 {
		t.Errorf("%d synced execs started %d exchange helpers (%d exec requests), want none: they did not run in the relay", n, k, used)
	}
	if pids := relayPIDs(t, run); !slices.Equal(pids, []int{relay}) {
		t.Errorf("relay processes after %d synced execs: %v, want the first one only (%d)", n, pids, relay)
	}

	// Ctrl-C reaches the command whose exchange runs in the relay.
	code, out, errb := e.killMidCommand(t, d, repo, []string{"exec", "--", "sh", "-c", `trap 'echo got INT; exit 9' INT; echo start; while :; do sleep 0.1; done`}, func(nook *os.Process) {
		if err := nook.Signal(syscall.SIGINT); err != nil {
			t.Fatal(err)
		}
	})
	if code != 9 || out != "start\ngot INT\n" {
		t.Errorf("Ctrl-C through the relay: exit %d, stdout %q, stderr %q; want exit 9 from the command's trap", code, out, errb)
	}
	if pids := relayPIDs(t, run); !slices.Equal(pids, []int{relay}) {
		t.Errorf("relay processes after a signal: %v, want the first one only (%d)", pids, relay)
	}
}

// TestKilledRelayIsReplacedAndItsCommandRunsOnce: a relay killed
// (SIGKILL) between two execs costs the next one nothing (it runs, its
// output and exit code exact); one killed while its command runs is a
// lost channel: the daemon attaches to the command, which goes on, and
// the caller gets all of its output and its exit code, the command run
// once.
func TestKilledRelayIsReplacedAndItsCommandRunsOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	d, repo, run, relay := e.relaySandbox(t, "relaykill")
	if err := syscall.Kill(relay, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if !waitFor(10*time.Second, func() bool { return processGone(relay) }) {
		t.Fatalf("relay %d did not die", relay)
	}
	r := e.nook(repo, "exec", "--no-sync", "--", "sh", "-c", "echo after the kill; exit 4")
	if r.code != 4 || r.stdout != "after the kill\n" || r.stderr != "" {
		t.Fatalf("the exec after the relay was killed: %s; want exit 4 and its line only", r)
	}
	relay = waitOneRelay(t, run)

	counter := counterFile(t, "relaykill")
	script := fmt.Sprintf(`echo start; echo ran >> %s; sleep 2; echo end; echo late >&2; exit 5`, counter)
	code, out, errb := e.killMidCommand(t, d, repo, []string{"exec", "--no-sync", "--", "sh", "-c", script}, func(*os.Process) {
		if err := syscall.Kill(relay, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	})
	checkReattached(t, d, "the exec whose relay was killed", result{code, out, errb}, 5, "relay ended while the command ran", counter)
	r = e.nook(repo, "exec", "--no-sync", "--", "echo", "next")
	if r.code != 0 || r.stdout != "next\n" {
		t.Errorf("the exec after: %s", r)
	}
}

// TestCommandThatErasesItsRecordIsNotRunAgain: a command that removes the
// holder's record of itself and has its relay killed (here by the test;
// the command could do it itself) is reported, not started again: the
// sandbox saying "never started" decides no second run.
func TestCommandThatErasesItsRecordIsNotRunAgain(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	d, repo, _, relay := e.relaySandbox(t, "erase")

	counter := counterFile(t, "erase")
	script := fmt.Sprintf(`echo ran >> %s; rm -rf "${XDG_CACHE_HOME:-$HOME/.cache}/sandboxd/hold" /dev/shm/sandboxd-*; echo start; sleep 2; echo end`, counter)
	code, out, errb := e.killMidCommand(t, d, repo, []string{"exec", "--no-sync", "--", "sh", "-c", script}, func(*os.Process) {
		if err := syscall.Kill(relay, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	})
	if n := strings.Count(readFileOr(counter), "ran"); n != 1 {
		d.stop(t)
		t.Fatalf("the command ran %d times, want once (exit %d, stdout %q, stderr %q)\n%s", n, code, out, errb, d.logs)
	}
	checkFailure(t, "the exec whose record was erased", result{code: code, stdout: out, stderr: errb})
	if !strings.Contains(errb, "no record of command") {
		t.Errorf("stderr %q does not say the sandbox had no record of the command", errb)
	}
	r := e.nook(repo, "exec", "--no-sync", "--", "echo", "next")
	if r.code != 0 || r.stdout != "next\n" {
		t.Errorf("the exec after: %s", r)
	}
}

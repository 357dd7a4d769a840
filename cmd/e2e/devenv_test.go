package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestCtrlCReturnsTheStatusOfACommandThatTrapsIt: a command that traps
// SIGINT and exits 7 makes nook exit 7 after one Ctrl-C, as it would in a
// local terminal, with and without sync (the wrapping remote shells must
// not report their own death by SIGINT).
func TestCtrlCReturnsTheStatusOfACommandThatTrapsIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("sigint7", defaultConfig)
	e.startSandbox(repo)
	for _, flags := range [][]string{{"--no-sync"}, nil} {
		args := append(append([]string{"exec"}, flags...), "--", "sh", "-c", `trap 'exit 7' INT; echo ready; while :; do sleep 0.05; done`)
		cmd := e.nookCmd(repo, args...)
		var errb strings.Builder
		cmd.Stderr = &errb
		stdout, _ := cmd.StdoutPipe()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 6)
		if _, err := io.ReadFull(stdout, buf); err != nil || string(buf) != "ready\n" {
			t.Fatalf("%v: command did not start: %q %v", flags, buf, err)
		}
		_ = cmd.Process.Signal(syscall.SIGINT)
		err := cmd.Wait()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 7 {
			t.Fatalf("%v: nook after one Ctrl-C: %v, want exit 7 (the command's own status); stderr: %s", flags, err, errb.String())
		}
	}
}

// TestMakeRunWithADaemonRunningLeavesTheLocalRemoteAlone: `make run` while
// a daemon already runs says so, and its exit trap does not stop the local
// remote it did not start: the other daemon's sandboxes, their background
// processes and their commands live on.
func TestMakeRunWithADaemonRunningLeavesTheLocalRemoteAlone(t *testing.T) {
	t.Parallel()
	needTool(t, "make", "apt-get install make")
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("makerun", defaultConfig)
	e.startSandbox(repo)
	e.mustNook(repo, "bg", "start", "--name", "sleeper", "--", "sleep", "600")
	lcPID := localcloudPID(t, e)

	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// -o build: the test's binaries, not a build of the tree.
	cmd := exec.CommandContext(ctx, "make", "-s", "-C", root, "-o", "build", "run", "BIN="+binDir, "VERSION=test")
	cmd.Env = e.vars
	out, err := cmd.CombinedOutput()
	if err == nil || ctx.Err() != nil {
		t.Fatalf("make run with a daemon running: %v (it must fail at once)\n%s", err, out)
	}
	if !strings.Contains(string(out), "a sandboxd already runs for this user") || !strings.Contains(string(out), "left running") {
		t.Fatalf("make run must say that a daemon runs and what it left alone:\n%s", out)
	}
	if err := syscall.Kill(lcPID, 0); err != nil {
		t.Fatalf("make run stopped the local remote (pid %d) it did not start:\n%s", lcPID, out)
	}
	list := decode[bgListJSON](t, e.mustNook(repo, "bg", "list", "--json").stdout)
	if len(list.Processes) != 1 || list.Processes[0].Status != "running" {
		t.Fatalf("the sandbox's background process must live on: %+v", list)
	}
	if r := e.mustNook(repo, "exec", "--no-sync", "--", "echo", "alive"); r.stdout != "alive\n" {
		t.Fatalf("exec after make run: %s", r)
	}
}

// localcloudPID is the running local remote's pid, from its discovery file.
func localcloudPID(t *testing.T, e *env) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(e.get("XDG_DATA_HOME"), "sandboxd", "localcloud", "localcloud.json"))
	if err != nil {
		t.Fatalf("the local remote's discovery file: %v", err)
	}
	var d struct {
		PID int `json:"pid"`
	}
	if err := json.Unmarshal(b, &d); err != nil || d.PID <= 0 {
		t.Fatalf("the local remote's discovery file: %v %s", err, b)
	}
	return d.PID
}

// goProjectConfig sets environment variables for the sandbox's commands
// the way RWX configs do: `env:` on the sandbox task (a plain string, or a
// mapping with `value:`).
const goProjectConfig = `tasks:
  - key: sandbox
    run: rwx-sandbox
    env:
      GREETING: hello from the config
      CGO_ENABLED:
        value: "0"
        cache-key: excluded
`

// TestGoBuildRunsWithTheSystemGoToolchain: `nook exec -- go test ./...`
// finds Go installed at /usr/local/go (on the sandbox's PATH when it
// exists), builds and tests a module, and the config's `env:` reaches the
// command.
func TestGoBuildRunsWithTheSystemGoToolchain(t *testing.T) {
	t.Parallel()
	if _, err := os.Stat("/usr/local/go/bin/go"); err != nil {
		missingTool(t, "Go at /usr/local/go", "install Go at /usr/local/go (the sandbox's PATH has /usr/local/go/bin)")
	}
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("gobuild", goProjectConfig)
	writeFile(t, filepath.Join(repo, "go.mod"), "module example.com/hello\n\ngo 1.21\n")
	writeFile(t, filepath.Join(repo, "hello.go"), "package hello\n\nfunc Hello() string { return \"hello\" }\n")
	writeFile(t, filepath.Join(repo, "hello_test.go"), "package hello\n\nimport \"testing\"\n\nfunc TestHello(t *testing.T) {\n\tif Hello() != \"hello\" {\n\t\tt.Fatal(Hello())\n\t}\n}\n")
	r := e.nook(repo, "exec", "--", "go", "test", "./...")
	if r.code != 0 || !strings.Contains(r.stdout, "ok  \texample.com/hello") {
		t.Fatalf("go test in the sandbox: %s", r)
	}
	r = e.mustNook(repo, "exec", "--no-sync", "--", "sh", "-c", `echo "$GREETING/$CGO_ENABLED"; go env CGO_ENABLED`)
	if r.stdout != "hello from the config/0\n0\n" {
		t.Fatalf("the config's env must reach the command: %s", r)
	}
}

// TestToolchainUnderHomeIsExposedReadOnly: a toolchain directory named in
// $SANDBOXD_LOCALCLOUD_TOOLCHAINS (which the local remote inherits from
// sandboxd) is seen by sandboxes at its own path, read-only, with its bin
// directory on PATH.
func TestToolchainUnderHomeIsExposedReadOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tool, err := os.MkdirTemp("", "nooktool")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(tool) })
	// A sandbox may run as another user (nobody, under root).
	if err := os.Chmod(tool, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(tool, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(tool, "bin", "hello-tool"), []byte("#!/bin/sh\necho tool says hi\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	// Writable by anyone here: only the read-only bind keeps the sandbox
	// from writing.
	if err := os.Chmod(filepath.Join(tool, "bin"), 0o777); err != nil {
		t.Fatal(err)
	}
	e.startDaemon("SANDBOXD_LOCALCLOUD_TOOLCHAINS=" + tool)
	repo := e.newRepo("toolchain", defaultConfig)
	if r := e.mustNook(repo, "exec", "--", "hello-tool"); r.stdout != "tool says hi\n" {
		t.Fatalf("the toolchain's bin directory must be on PATH: %s", r)
	}
	r := e.nook(repo, "exec", "--no-sync", "--", "sh", "-c", "touch "+filepath.Join(tool, "bin", "planted")+" 2>&1; echo status=$?")
	if strings.Contains(r.stdout, "status=0") {
		t.Fatalf("the toolchain must be read-only in the sandbox: %s", r)
	}
	if _, err := os.Stat(filepath.Join(tool, "bin", "planted")); err == nil {
		t.Fatal("a sandbox wrote into the toolchain directory")
	}
}

// TestExecRunsInTheCallersSubdirectory: `cd pkg/p3 && nook exec -- ...` runs
// in the sandbox's pkg/p3, synced or not, and --root at the checkout's
// root; MCP's exec does the same with cwd (and root); a directory the
// sandbox lacks is reported, not silently replaced by the root.
func TestExecRunsInTheCallersSubdirectory(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("subdir", defaultConfig)
	sub := filepath.Join(repo, "pkg", "p3")
	writeFile(t, filepath.Join(sub, "here.txt"), "p3\n")
	e.git(repo, "add", "-A")
	e.git(repo, "commit", "-qm", "p3")
	e.git(repo, "push", "-q")
	e.startSandbox(repo)

	for _, flags := range [][]string{nil, {"--no-sync"}} {
		args := append(append([]string{"exec"}, flags...), "--", "sh", "-c", `pwd; cat here.txt`)
		r := e.mustNook(sub, args...)
		if !strings.HasSuffix(strings.SplitN(r.stdout, "\n", 2)[0], "/pkg/p3") || !strings.HasSuffix(r.stdout, "\np3\n") {
			t.Fatalf("%v: exec from pkg/p3 must run in the sandbox's pkg/p3: %s", flags, r)
		}
		args = append(append([]string{"exec", "--root"}, flags...), "--", "sh", "-c", `test -d pkg/p3 && test -f README.md && echo at-root`)
		if r := e.mustNook(sub, args...); r.stdout != "at-root\n" {
			t.Fatalf("%v: --root must run at the checkout's root: %s", flags, r)
		}
	}
	// An edit made by the command in the subdirectory comes back there.
	e.mustNook(sub, "exec", "--", "sh", "-c", "echo made > made.txt")
	if got := readFile(t, filepath.Join(sub, "made.txt")); got != "made\n" {
		t.Fatalf("the file made in pkg/p3 came back as %q", got)
	}
	// A directory with no file is not synced: said, with exit 125.
	empty := filepath.Join(repo, "empty")
	if err := os.MkdirAll(empty, 0o755); err != nil {
		t.Fatal(err)
	}
	if r := e.nook(empty, "exec", "--", "true"); r.code != 125 || !strings.Contains(r.stderr, "the sandbox has no directory empty") || !strings.Contains(r.stderr, "--root") {
		t.Fatalf("exec from a directory the sandbox lacks: %s", r)
	}

	cs := e.mcpSession(t, repo)
	_, out := callTool(t, cs, "exec", map[string]any{"cwd": sub, "command": "cat here.txt", "noSync": true})
	if out["stdout"] != "p3\n" || out["exitCode"] != float64(0) {
		t.Fatalf("MCP exec with cwd pkg/p3 must run there: %v", out)
	}
	_, out = callTool(t, cs, "exec", map[string]any{"cwd": sub, "root": true, "command": "cat pkg/p3/here.txt"})
	if out["stdout"] != "p3\n" || out["exitCode"] != float64(0) {
		t.Fatalf("MCP exec with root must run at the checkout's root: %v", out)
	}
}

// TestShellIsTheUsersShellElseBash: under a real terminal (tmux), `nook
// shell` opens bash when the caller's login shell is one the sandbox lacks
// (and bash rather than dash, whose line editing and history it lacks),
// the caller's own shell when the sandbox has it, with SHELL naming it and
// the sandbox's PATH kept (no profile resets it).
func TestShellIsTheUsersShellElseBash(t *testing.T) {
	t.Parallel()
	if _, err := os.Stat("/bin/bash"); err != nil {
		missingTool(t, "bash", "apt-get install bash (the sandbox sees this machine's /bin)")
	}
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("shellpick", defaultConfig)
	e.startSandbox(repo)
	probe := `echo SH-$((1+1))-${BASH_VERSION:+bash}-$SHELL-$PATH`
	for _, c := range []struct{ login, want string }{
		{"/opt/nowhere/nook-no-such-shell", `SH-2-bash-/\S*bash-`},
		{"/bin/sh", `SH-2--/bin/sh-`},
	} {
		p := e.tmux(t, repo, "SHELL="+c.login+" nook shell --no-sync; sleep 600")
		p.line(probe)
		got := p.waitFor(`SH-2-\S*`)
		if !regexp.MustCompile(c.want).MatchString(got) {
			t.Fatalf("SHELL=%s: nook shell gave %q, want %s", c.login, got, c.want)
		}
		if _, err := os.Stat("/usr/local/go/bin"); err == nil && !strings.Contains(got, "/usr/local/go/bin") {
			t.Fatalf("SHELL=%s: the shell's PATH lost the sandbox's toolchains: %q", c.login, got)
		}
		p.line("exit")
	}
}

// newRepoWithoutConfig is a repository with no sandbox config at all.
func (e *env) newRepoWithoutConfig(name string) string {
	e.t.Helper()
	repo := e.newRepo(name, defaultConfig)
	e.git(repo, "rm", "-q", "-r", ".rwx")
	e.git(repo, "commit", "-q", "-m", "no config")
	if _, err := os.Stat(filepath.Join(repo, ".rwx")); err == nil {
		e.t.Fatal(".rwx is still there")
	}
	return repo
}

// TestFailedExecWithoutConfigLeavesNothingBehind: nook exec (and start) in
// a repository with no sandbox config fails, telling to run nook init, and
// leaves no .rwx directory (no .gitignore, no lock file) in the checkout.
func TestFailedExecWithoutConfigLeavesNothingBehind(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepoWithoutConfig("noconfig")
	for _, args := range [][]string{{"exec", "--", "true"}, {"start"}, {"status"}} {
		r := e.nook(repo, args...)
		if args[0] != "status" && (r.code == 0 || !strings.Contains(r.stderr, "nook init")) {
			t.Fatalf("nook %v without a config: %s (want a failure that says nook init)", args, r)
		}
		if _, err := os.Stat(filepath.Join(repo, ".rwx")); err == nil {
			out, _ := exec.Command("find", filepath.Join(repo, ".rwx")).CombinedOutput()
			t.Fatalf("nook %v without a config left files behind:\n%s", args, out)
		}
	}
}

// TestBrokenDaemonConfigIsReported: a config.json broken while the daemon
// runs (and refused by its reload) is reported, every problem of it, by
// `nook daemon status` (no longer a plain "running (ok)") and by a failing
// `nook doctor` check with the fix.
func TestBrokenDaemonConfigIsReported(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	d := e.startDaemon()
	repo := e.newRepo("brokencfg", defaultConfig)
	writeFile(t, filepath.Join(e.get("XDG_CONFIG_HOME"), "sandboxd", "config.json"), `{"idle_timeout": "ten minutes", "log_levle": "debug"}`)
	if err := d.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	r := e.mustNook(repo, "daemon", "status")
	if strings.Contains(r.stdout, "running (ok)") || !strings.Contains(r.stdout, `field "idle_timeout"`) || !strings.Contains(r.stdout, `unknown field "log_levle"`) {
		t.Fatalf("daemon status must report every problem of the config file:\n%s", r)
	}
	r = e.nook(repo, "doctor", "--json")
	type check struct {
		Name, Detail, Fix string
		OK                bool
	}
	out := decode[struct{ Checks []check }](t, r.stdout)
	var cfg *check
	for i, c := range out.Checks {
		if c.Name == "config" {
			cfg = &out.Checks[i]
		}
	}
	if r.code != 1 || cfg == nil || cfg.OK || !strings.Contains(cfg.Detail, "2 problems") || cfg.Fix == "" {
		t.Fatalf("doctor must fail a config check, with the fix: %+v\n%s", cfg, r)
	}
}

// TestMessagesANewUserMeets: the messages of issue 31's rough edges say
// the right thing once: nook init when there is no config; the -- a
// command needs; the command a typo meant; no "safe to retry" where
// retrying cannot help, and the advice in --json's hint; a remote that
// cannot be reached named once.
func TestMessagesANewUserMeets(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepoWithoutConfig("messages")
	if r := e.mustNook(repo, "status"); !strings.Contains(r.stdout, "`nook init`") {
		t.Errorf("status without a config must say nook init: %s", r)
	}
	if r := e.nook(repo, "exec", "ls", "README.md"); r.code == 0 || !strings.Contains(r.stderr, "`nook exec -- ls README.md`") {
		t.Errorf("exec without --: %s", r)
	}
	if r := e.nook(repo, "exce"); r.code == 0 || !strings.Contains(r.stderr, `did you mean "exec"?`) || strings.Contains(r.stderr, "help `") {
		t.Errorf("a mistyped command: %s", r)
	}
	outside := filepath.Join(e.root, "outside")
	if err := os.MkdirAll(outside, 0o755); err != nil {
		t.Fatal(err)
	}
	if r := e.nook(outside, "exec", "--", "true"); r.code != 125 || strings.Contains(r.stderr, "safe to retry") {
		t.Errorf("outside a repository, retrying cannot help: %s", r)
	}
	r := e.nook(outside, "exec", "--json", "--", "true")
	rec := decode[struct{ Code, Message, Hint string }](t, r.stdout)
	if rec.Code != "invalid" || !strings.HasPrefix(rec.Hint, "run nook from your project's checkout") || strings.Contains(rec.Message, "run nook") {
		t.Errorf("--json must put the advice in hint: %+v", rec)
	}

	// A remote that cannot be reached: its address and the call, once.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	host := ln.Addr().String()
	ln.Close()
	e2 := newEnv(t)
	e2.startDaemon("SANDBOXD_REMOTE=rwx", "RWX_HOST="+host, "RWX_ACCESS_TOKEN=tok")
	r = e2.nook(e2.root, "list")
	if strings.Count(r.stderr, host) != 1 || strings.Count(r.stderr, "list sandboxes") != 1 {
		t.Errorf("the unreachable remote's message repeats itself: %s", r)
	}
	repo2 := e2.newRepo("unreachable", defaultConfig)
	r = e2.nook(repo2, "start")
	if r.code == 0 || strings.Count(r.stderr, host) != 1 || strings.Count(r.stderr, "create") != 1 {
		t.Errorf("the unreachable remote's create message repeats itself: %s", r)
	}
}

// TestNeovimExecRunsInTheSubdirectory: :Nook exec from a Neovim whose
// current directory is pkg/p3 of a checkout runs in the sandbox's pkg/p3.
func TestNeovimExecRunsInTheSubdirectory(t *testing.T) {
	t.Parallel()
	nvim := needTool(t, "nvim", "apt-get install neovim")
	plugin, err := filepath.Abs(filepath.Join("..", "..", "contrib", "nvim"))
	if err != nil {
		t.Fatal(err)
	}
	script, err := filepath.Abs(filepath.Join("testdata", "nvim_subdir.lua"))
	if err != nil {
		t.Fatal(err)
	}
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("nvimsub", defaultConfig)
	sub := filepath.Join(repo, "pkg", "p3")
	writeFile(t, filepath.Join(sub, "here.txt"), "in p3\n")
	e.mustNook(repo, "start", "--wait")

	outFile := filepath.Join(e.root, "nvim.json")
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, nvim, "--headless", "-u", "NONE", "-i", "NONE", "-n",
		"--cmd", "set rtp^="+plugin, "-c", "luafile "+script)
	cmd.Dir = sub
	cmd.Env = e.with("NOOK_NVIM_OUT=" + outFile)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("nvim: %v\n%s", err, out)
	}
	got := decode[struct {
		Error    string `json:"error"`
		Text     string `json:"text"`
		ExitCode int    `json:"exit_code"`
	}](t, readFile(t, outFile))
	if got.Error != "" || got.ExitCode != 0 || !strings.Contains(got.Text, "in p3") {
		t.Fatalf(":Nook exec from pkg/p3 must run in the sandbox's pkg/p3: %+v", got)
	}
}

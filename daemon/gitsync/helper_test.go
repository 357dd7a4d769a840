//go:build linux

package gitsync

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

// The sync's scenarios again, with the sandbox helper serving on the
// sandbox as the daemon runs it (daemon/helper): staging looks only at what
// changed once the helper's first stage is done, and every scenario's
// outcome is the same as with git add -A.
//
// Most of their execs are native (the helper moves the working tree and
// finds the edits itself; see TestFusedWithTheHelperIsNative): the count
// shows the scenarios run that way.
func TestScenariosWithTheSandboxHelper(t *testing.T) {
	nativeExecs.Store(0)
	for name, test := range syncScenarios() {
		t.Run(name, func(t *testing.T) {
			useHelper = true
			t.Cleanup(func() { useHelper = false })
			test(t)
		})
	}
	if n := nativeExecs.Load(); n < 15 {
		t.Fatalf("%d fused execs were native", n)
	}
	t.Logf("%d fused execs were native", nativeExecs.Load())
}

// With the helper serving, a synced exec after the first is native: the
// helper moves the working tree and finds the command's edits itself, so
// no git process that reads or writes an index runs in the sandbox (each
// costs what the tree holds). An exec whose command edits nothing runs no
// git at all, HEAD being where it was; an edit costs one git diff-tree.
func TestFusedWithTheHelperIsNative(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	log := gitLog(t) // before the fixture: the helper's server inherits it
	f := newFixture(t, map[string]string{"a.txt": "a\n", "b.txt": "b\n", "dir/c.txt": "c\n"})
	writeFile(t, filepath.Join(f.local, "a.txt"), "one\n")
	// The first exec finds the helper without a base: the plain way, after
	// which the helper adopts the tree it made.
	if _, fr, err := f.fused("echo left > left.txt"); err != nil || !fr.Native {
		t.Fatalf("first exec: native %v, err %v", fr.Native, err)
	}
	if err := os.Remove(filepath.Join(f.local, "left.txt")); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(f.local, "a.txt"), "two\n")
	writeFile(t, filepath.Join(f.local, "dir/new.txt"), "new\n")
	if err := os.Remove(filepath.Join(f.local, "dir/c.txt")); err != nil {
		t.Fatal(err)
	}
	mark := len(sandboxCalls(t, log, f.sandbox))
	out, fr, err := f.fused("cat a.txt dir/new.txt; ls . dir")
	if err != nil || !fr.Native {
		t.Fatalf("second exec: native %v, err %v", fr.Native, err)
	}
	if want := "two\nnew\na.txt\nb.txt\ndir\n\ndir:\nnew.txt\n"; out != want && out != "two\nnew\n.:\na.txt\nb.txt\ndir\n\ndir:\nnew.txt\n" {
		t.Fatalf("the command saw %q", out)
	}
	if calls := sandboxCalls(t, log, f.sandbox)[mark:]; len(calls) != 0 {
		t.Fatalf("a native exec ran git in the sandbox: %v", calls)
	}
	// The sandbox's refs are as the plain way leaves them: HEAD and the
	// base at head, the snapshot a commit of the synced tree on head.
	head := strings.TrimSpace(testutil.Git(t, f.local, "rev-parse", "HEAD"))
	snap := strings.TrimSpace(testutil.Git(t, f.sandbox, "rev-parse", SnapshotRef))
	if got := strings.TrimSpace(testutil.Git(t, f.sandbox, "rev-parse", "HEAD", BaseRef, snap+"^")); got != head+"\n"+head+"\n"+head {
		t.Fatalf("HEAD, base and the snapshot's parent are %q, want %s", got, head)
	}
	if got, want := workingTree(t, f.sandbox), strings.TrimSpace(testutil.Git(t, f.sandbox, "rev-parse", snap+"^{tree}")); got != want {
		t.Fatalf("the working tree is %s, the snapshot's tree %s", got, want)
	}
	testutil.Git(t, f.sandbox, "fsck", "--strict", "--no-dangling")

	// A command that edits brings its edits back, by one git diff-tree.
	mark = len(sandboxCalls(t, log, f.sandbox))
	if _, fr, err := f.fused("echo more >> b.txt; echo x > dir/made.txt; rm a.txt"); err != nil || !fr.Native {
		t.Fatalf("third exec: native %v, err %v", fr.Native, err)
	}
	if calls := sandboxCalls(t, log, f.sandbox)[mark:]; strings.Join(calls, " ") != "check-ignore diff-tree" {
		t.Fatalf("the native pull ran %v, want check-ignore (dir/made.txt is new) and diff-tree", calls)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "b.txt"))); got != "b\nmore\n" {
		t.Fatalf("b.txt is %q locally", got)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "dir/made.txt"))); got != "x\n" {
		t.Fatalf("dir/made.txt is %q locally", got)
	}
	if _, err := os.Lstat(filepath.Join(f.local, "a.txt")); !os.IsNotExist(err) {
		t.Fatalf("a.txt is still here: %v", err)
	}
}

// Attributes that convert nothing (binary files, diff drivers, linguist
// hints) leave the native sync on.
func TestNativeWithAttributesThatConvertNothing(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	f := newFixture(t, map[string]string{".gitattributes": "*.png binary\n*.go diff=golang linguist-generated\n", "a.txt": "a\n"})
	for i, text := range []string{"one\n", "two\n"} {
		writeFile(t, filepath.Join(f.local, "a.txt"), text)
		if _, fr, err := f.fused("true"); err != nil || !fr.Native {
			t.Fatalf("exec %d: native %v, err %v", i, fr.Native, err)
		}
		if got := string(fileBytes(t, filepath.Join(f.sandbox, "a.txt"))); got != text {
			t.Fatalf("exec %d: the sandbox's a.txt is %q", i, got)
		}
	}
	if b := fileBytes(t, filepath.Join(f.sandbox, ".git", "sandboxd", "native.err")); len(b) != 0 {
		t.Fatalf("the second push declined: %s", b)
	}
}

// Where the working tree is not its blobs (attributes that convert line
// ends), the helper declines for good and the plain way syncs: the sandbox
// holds what git's checkout makes, and later execs do not ask the helper
// again until head changes.
func TestNativeDeclinesForAttributes(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	f := newFixture(t, map[string]string{".gitattributes": "*.txt eol=crlf\n", "a.txt": "a\n"})
	for i, text := range []string{"one\n", "two\n"} {
		writeFile(t, filepath.Join(f.local, "a.txt"), text)
		if _, fr, err := f.fused("true"); err != nil || fr.Native {
			t.Fatalf("exec %d: native %v, err %v", i, fr.Native, err)
		}
		want := strings.ReplaceAll(text, "\n", "\r\n")
		if got := string(fileBytes(t, filepath.Join(f.sandbox, "a.txt"))); got != want {
			t.Fatalf("exec %d: the sandbox's a.txt is %q, want %q", i, got, want)
		}
	}
	off := string(fileBytes(t, filepath.Join(f.sandbox, ".git", "sandboxd", "native.off")))
	if !strings.HasPrefix(off, f.r.helperInstance+" ") {
		t.Fatalf("native.off is %q", off)
	}
}

// workingTree is the tree of dir's working tree as git add -A sees it,
// made in a scratch index.
func workingTree(t *testing.T, dir string) string {
	t.Helper()
	index := filepath.Join(t.TempDir(), "index")
	for _, args := range [][]string{{"add", "-A"}, {"write-tree"}} {
		cmd := exec.Command("git", args...)
		cmd.Dir, cmd.Env = dir, append(os.Environ(), "GIT_INDEX_FILE="+index)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("git %v: %v: %s", args, err, out)
		}
		if args[0] == "write-tree" {
			return strings.TrimSpace(string(out))
		}
	}
	return ""
}

// End to end, a directory the command made, filled and replaced by a
// symbolic link to somewhere else comes back as git sees it: the link
// alone, the files behind it untouched; and since the link points out of
// the checkout, it is refused and reported, not applied. (The tracker reports the directory
// here, which the move's own checks catch; sandboxhelper's
// TestNativePullDoesNotReadThroughASymlink names a file under the link to
// prove the check of a path beyond a link.)
func TestNativeExecBringsBackALinkThatReplacedADirectory(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	outside := t.TempDir()
	writeFile(t, filepath.Join(outside, "c.txt"), "outside\n")
	if _, fr, err := f.fused("true"); err != nil || !fr.Native {
		t.Fatalf("first exec: native %v, err %v", fr.Native, err)
	}
	_, fr, err := f.fused("mkdir dir && echo c > dir/c.txt && rm -r dir && ln -s " + outside + " dir")
	if err != nil || !fr.Native {
		t.Fatalf("second exec: native %v, err %v", fr.Native, err)
	}
	if len(fr.Pull.Refused) != 1 || fr.Pull.Refused[0].Path != "dir" || fr.Pull.SavedPatch == "" {
		t.Fatalf("the link out of the checkout was not refused: %+v", fr.Pull)
	}
	if _, err := os.Lstat(filepath.Join(f.local, "dir")); err == nil {
		t.Fatal("the link out of the checkout was applied")
	}
	if !strings.Contains(string(fileBytes(t, fr.Pull.SavedPatch)), "+"+outside) {
		t.Fatalf("the saved patch lacks the link")
	}
	if got := string(fileBytes(t, filepath.Join(outside, "c.txt"))); got != "outside\n" {
		t.Fatalf("the file behind the link is %q", got)
	}
}

// End to end, a push never writes through a symbolic link that replaced a
// directory of the sandbox after the last exec: the helper declines (the
// directory in the tracker's answer is a link where head has a directory)
// and the plain way puts the directory back. sandboxhelper's
// TestNativePushDoesNotWriteThroughASymlink proves the check of a path
// beyond a link.
func TestNativePushDoesNotWriteThroughALinkThatReplacedADirectory(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	f := newFixture(t, map[string]string{"a.txt": "a\n", "dir/c.txt": "c\n"})
	outside := t.TempDir()
	writeFile(t, filepath.Join(outside, "c.txt"), "outside\n")
	if _, fr, err := f.fused("true"); err != nil || !fr.Native {
		t.Fatalf("first exec: native %v, err %v", fr.Native, err)
	}
	f.inSandbox("rm -r dir && ln -s " + outside + " dir")
	writeFile(t, filepath.Join(f.local, "dir/c.txt"), "changed\n")
	if out, _, err := f.exec("cat dir/c.txt"); err != nil || out != "changed\n" {
		t.Fatalf("the command saw %q (%v)", out, err)
	}
	if got := string(fileBytes(t, filepath.Join(outside, "c.txt"))); got != "outside\n" {
		t.Fatalf("the push wrote through the link: %q", got)
	}
	if fi, err := os.Lstat(filepath.Join(f.sandbox, "dir")); err != nil || !fi.IsDir() {
		t.Fatalf("the sandbox's dir is not a directory again: %v", err)
	}
}

// In the helper's run (push, command and pull in one process), Ctrl-C at
// the command's process group ends the command, not the run: the command's
// edits are still pulled and its status is reported.
func TestNativeRunSurvivesTheGroupSignal(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	if _, fr, err := f.fused("true"); err != nil || !fr.Native {
		t.Fatalf("first exec: native %v, err %v", fr.Native, err)
	}
	ctx := context.Background()
	p, err := f.s.Prepare(ctx, f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	p.Sandbox = "fixture"
	x, ok, err := f.s.Fuse(ctx, f.r, p, "echo edited > a.txt; echo ready; while :; do sleep 0.05; done")
	if err != nil || !ok {
		t.Fatalf("fuse: %v %v", ok, err)
	}
	// The agent relays a signal to the exec's process group: the helper,
	// which passes it to the command's own group.
	cmd := exec.Command("/bin/sh", "-c", x.Command())
	cmd.Dir = f.sandbox
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	pr, pw := io.Pipe()
	ready := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(pr).ReadString('\n')
		ready <- line
		_, _ = io.Copy(io.Discard, pr)
	}()
	runner := runnerFunc(func(ctx context.Context, command string, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
		cmd.Stdout, cmd.Stderr = stdout, stderr
		in, err := cmd.StdinPipe()
		if err != nil {
			return -1, err
		}
		if err := cmd.Start(); err != nil {
			return -1, err
		}
		go func() { _, _ = io.Copy(in, stdin); _ = in.Close() }()
		select {
		case line := <-ready:
			if line != "ready\n" {
				t.Errorf("the command wrote %q", line)
			}
		case <-time.After(20 * time.Second):
			t.Error("the command did not start")
		}
		if err := syscall.Kill(-cmd.Process.Pid, syscall.SIGINT); err != nil {
			t.Error(err)
		}
		_ = cmd.Wait()
		return cmd.ProcessState.ExitCode(), nil
	})
	if err := x.Run(ctx, runner, ExchangeIO{Stdout: pw}); err != nil {
		t.Fatal(err)
	}
	pw.Close()
	f.r.reset()
	fr, err := x.Finish(ctx, f.r)
	if err != nil || !fr.Ran || !fr.Native || fr.ExitCode != 130 {
		t.Fatalf("finish: ran %v native %v exit %d, err %v", fr.Ran, fr.Native, fr.ExitCode, err)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "a.txt"))); got != "edited\n" {
		t.Fatalf("a.txt is %q locally", got)
	}
	if calls := f.r.calls(); calls != 0 {
		t.Fatalf("finishing made %d runner calls: the pull was not in the exchange", calls)
	}
}

// Whatever changes the sandbox between two native execs (a --no-sync
// command, a background process) is healed by the next native push, which
// looks at the paths the tracker names: HEAD, index and files as the local
// side has them.
func TestNativePushHealsChangesBetweenExecs(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	for name, change := range changesBetweenExecs() {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t, map[string]string{"a.txt": "a\n", "b.txt": "b\n"})
			writeFile(t, f.local+"/b.txt", "local b\n")
			for i := 0; i < 2; i++ { // the first adopts, the second is native
				if _, fr, err := f.fused("true"); err != nil || !fr.Native {
					t.Fatalf("exec %d: native %v, err %v", i, fr.Native, err)
				}
			}
			f.inSandbox(change)
			// What the change did to the files comes back first
			// (strayEdits), then the sandbox is as the local side.
			_, fr, err := f.fused("true")
			if err != nil || !fr.Native {
				t.Fatalf("healing exec: native %v, err %v", fr.Native, err)
			}
			if native := string(fileBytes(t, filepath.Join(f.sandbox, ".git", "sandboxd", "native.err"))); native != "" {
				t.Fatalf("the healing push was not native: %s", native)
			}
			assertTree(t, f.sandbox, tree(t, f.local))
			if got := strings.TrimSpace(testutil.Git(t, f.sandbox, "rev-parse", "HEAD")); got != f.base {
				t.Fatalf("sandbox HEAD %s, want base %s", got, f.base)
			}
			for _, state := range []string{"MERGE_HEAD", "MERGE_MSG"} {
				if out := f.inSandbox("test -e .git/" + state + " && echo left || true"); out != "" {
					t.Fatalf("%s left behind", state)
				}
			}
		})
	}
}

// A native exec's command that exits with the codes with which the helper
// once declined (75, 76) is reported with them and never run again by the
// plain way.
func TestNativeRunReportsTheCommandsOwnStatus(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "count\n"})
	if _, fr, err := f.fused("true"); err != nil || !fr.Native {
		t.Fatalf("first exec: native %v, err %v", fr.Native, err)
	}
	for _, code := range []int{75, 76, 1} {
		_, fr, err := f.fused(fmt.Sprintf("echo run >> count; exit %d", code))
		if err != nil || !fr.Native || fr.ExitCode != code {
			t.Fatalf("exit %d: native %v, reported %d, err %v", code, fr.Native, fr.ExitCode, err)
		}
	}
	if got := f.inSandbox("cat count"); got != "run\nrun\nrun\n" {
		t.Fatalf("the commands ran %q", got)
	}
}

// A local .gitignore that differs from head (an edit not committed yet)
// costs one plain exec when it changes, not every exec.
func TestNativeWithAnEditedGitignore(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	f := newFixture(t, map[string]string{".gitignore": "*.o\n", "a.txt": "a\n"})
	writeFile(t, filepath.Join(f.local, ".gitignore"), "*.o\n*.tmp\n")
	for i, text := range []string{"one\n", "two\n", "three\n"} {
		writeFile(t, filepath.Join(f.local, "a.txt"), text)
		out, fr, err := f.fused("cat a.txt; echo x > made.tmp; echo y > made.txt")
		if err != nil || !fr.Native || out != text {
			t.Fatalf("exec %d: native %v, saw %q, err %v", i, fr.Native, out, err)
		}
	}
	if b := fileBytes(t, filepath.Join(f.sandbox, ".git", "sandboxd", "native.err")); len(b) != 0 {
		t.Fatalf("the third push declined: %s", b)
	}
	if _, err := os.Lstat(filepath.Join(f.local, "made.tmp")); !os.IsNotExist(err) {
		t.Fatalf("an ignored file came back: %v", err)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "made.txt"))); got != "y\n" {
		t.Fatalf("made.txt is %q", got)
	}
}

// A helper whose run fails before it reports (an older binary, a crash at
// its start) leaves the exchange to the plain way, which runs the command
// once; the result of an earlier run is never read as this one's.
func TestNativeRunThatFailsEarlyIsNotReadAsTheLastOne(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "count\n"})
	for i := 0; i < 2; i++ {
		if _, fr, err := f.fused("true"); err != nil || !fr.Native {
			t.Fatalf("exec %d: native %v, err %v", i, fr.Native, err)
		}
	}
	f.breakHelperRun()
	out, fr, err := f.fused("echo run >> count; echo ran")
	if err != nil || fr.Native || out != "ran\n" {
		t.Fatalf("native %v, output %q, err %v", fr.Native, out, err)
	}
	if got := f.inSandbox("cat count"); got != "run\n" {
		t.Fatalf("the command ran %q", got)
	}
}

// Modes travel both ways through the native sync: a file made executable
// locally is executable in the sandbox after a native push, and one the
// command makes executable (or not) comes back so.
func TestNativeSyncCarriesModes(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	f := newFixture(t, map[string]string{"a.sh": "#!/bin/sh\n", "b.sh": "#!/bin/sh\n"})
	if _, fr, err := f.fused("true"); err != nil || !fr.Native {
		t.Fatalf("first exec: native %v, err %v", fr.Native, err)
	}
	if err := os.Chmod(filepath.Join(f.local, "a.sh"), 0o755); err != nil {
		t.Fatal(err)
	}
	out, fr, err := f.fused("test -x a.sh && echo exec; chmod +x b.sh")
	if err != nil || !fr.Native || out != "exec\n" {
		t.Fatalf("native %v, err %v, the command saw %q (want a.sh executable)", fr.Native, err, out)
	}
	if fi, err := os.Stat(filepath.Join(f.local, "b.sh")); err != nil || fi.Mode()&0o100 == 0 {
		t.Fatalf("b.sh, made executable in the sandbox, is %v locally (%v)", fi.Mode(), err)
	}
}

// After a native pull the helper's run prints the exchange's report
// itself: the wrapper shell starts no process once the command ended (its
// own way took wc and cat, and a subshell, for every edit brought back),
// and the edits, the exit status and a signal's death still come back.
func TestNativeRunReportsItself(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	// wc and cat, first on the PATH the scripts see, log their use.
	stubs := t.TempDir()
	used := filepath.Join(t.TempDir(), "used")
	for _, tool := range []string{"wc", "cat"} {
		real, err := exec.LookPath(tool)
		if err != nil {
			t.Fatal(err)
		}
		writeFile(t, filepath.Join(stubs, tool), fmt.Sprintf("#!/bin/sh\necho %s >>%s\nexec %s \"$@\"\n", tool, used, real))
		if err := os.Chmod(filepath.Join(stubs, tool), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("PATH", stubs+string(os.PathListSeparator)+os.Getenv("PATH"))
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	if _, fr, err := f.fused("true"); err != nil || !fr.Native {
		t.Fatalf("first exec: native %v, err %v", fr.Native, err)
	}
	writeFile(t, filepath.Join(f.local, "a.txt"), "local\n")
	_ = os.Remove(used)
	out, fr, err := f.fused("echo made >new.txt; echo out; exit 3")
	if err != nil || !fr.Native || !fr.Ran || fr.ExitCode != 3 {
		t.Fatalf("native %v, ran %v, exit %d, err %v", fr.Native, fr.Ran, fr.ExitCode, err)
	}
	if out != "out\n" {
		t.Fatalf("the command's output is %q", out)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "new.txt"))); got != "made\n" {
		t.Fatalf("new.txt is %q locally", got)
	}
	if b, err := os.ReadFile(used); err == nil {
		t.Fatalf("the wrapper ran %q after the command", b)
	}
	// A command that a signal ends: its status is still the signal's.
	_, fr, err = f.fused("echo again >>new.txt; kill -TERM $$")
	if err != nil || !fr.Native || fr.ExitCode != 128+15 {
		t.Fatalf("signalled: native %v, exit %d, err %v", fr.Native, fr.ExitCode, err)
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "new.txt"))); got != "made\nagain\n" {
		t.Fatalf("new.txt is %q locally after the signalled command", got)
	}
}

// A pull over the limit, in the helper's exchange: the header alone
// travels, and the daemon copies the kept patch (named by the pull.id the
// helper wrote) to a local file, as after the pull script's.
func TestNativeRunReportsAPullOverTheLimit(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	if _, fr, err := f.fused("true"); err != nil || !fr.Native {
		t.Fatalf("first exec: native %v, err %v", fr.Native, err)
	}
	f.s.maxBytes = 4 << 10
	f.finishCalls = 1 // the copy of the kept patch
	_, fr, err := f.fused("i=0; while [ $i -lt 400 ]; do echo line $i of a file over the limit; i=$((i+1)); done >big.txt")
	if err != nil || !fr.Native || !fr.Ran {
		t.Fatalf("native %v, ran %v, err %v", fr.Native, fr.Ran, err)
	}
	if !errors.Is(fr.PullErr, ErrPatchTooLarge) {
		t.Fatalf("the pull: %v, want ErrPatchTooLarge", fr.PullErr)
	}
	if fr.Pull.SavedPatch == "" || !strings.Contains(fr.PullErr.Error(), fr.Pull.SavedPatch) {
		t.Fatalf("the pull's patch was not copied here: %q, %v", fr.Pull.SavedPatch, fr.PullErr)
	}
	if b := fileBytes(t, fr.Pull.SavedPatch); !strings.Contains(string(b), "line 399 of a file over the limit") {
		t.Fatalf("the saved patch lacks the file's end: %d bytes", len(b))
	}

	// Asked for another exec's patch than the one it keeps, the sandbox
	// refuses, and the error says why.
	ctx := context.Background()
	rp, err := f.s.openRepo(ctx, f.local)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.s.fetchToFile(ctx, f.r, rp, "abcdef0123", 10); err == nil || !strings.Contains(err.Error(), "no longer keeps exec abcdef0123's patch") {
		t.Fatalf("fetching another exec's patch: %v", err)
	}
}

// Exchange after exchange with the helper, through edits, a mode change,
// content back to HEAD's, a removal, entries of 18 KB and a quote in a
// path, the command sees the local tree, the sandbox ends up as the local
// tree, and the command's edits come back. A helper that then does not
// answer (here its run fails at the start) costs no second exchange: the
// separate steps follow and the command runs once.
func TestExchangesLeaveTheSandboxAsTheLocalTree(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	f := newFixture(t, map[string]string{"a.txt": "a\n", "b.txt": "b\n", "dir/c.txt": "c\n", ".gitignore": "count\n"})
	steps := []struct {
		change  func()
		command string
	}{
		{func() { writeFile(t, filepath.Join(f.local, "a.txt"), "one\n") }, "true"},
		{func() { writeFile(t, filepath.Join(f.local, "n.txt"), "n\n") }, "true"},
		{func() { writeFile(t, filepath.Join(f.local, "a.txt"), "two\n") }, "cat a.txt"},
		{func() {
			writeFile(t, filepath.Join(f.local, "a.txt"), "three\n")
			writeFile(t, filepath.Join(f.local, "n.txt"), "n2\n")
		}, "echo from-sandbox >> b.txt"},
		{func() { writeFile(t, filepath.Join(f.local, "b.txt"), "b local\n") }, "true"},
		{func() {
			if err := os.Chmod(filepath.Join(f.local, "a.txt"), 0o755); err != nil {
				t.Fatal(err)
			}
		}, "test -x a.txt"},
		// Back to HEAD's content: the records say so, the sandbox too.
		{func() { writeFile(t, filepath.Join(f.local, "b.txt"), "b\n") }, "cat b.txt"},
		{func() { rm(f, "n.txt") }, "test ! -e n.txt"},
		// Entries of 18 KB (an argument of the helper's run, where a
		// here-document over 4 KiB cost the sandbox's sh a fork).
		{func() { writeFile(t, filepath.Join(f.local, "big.txt"), strings.Repeat("0123456789\n", 900)) }, "true"},
		{func() { writeFile(t, filepath.Join(f.local, "big.txt"), strings.Repeat("abcdefghij\n", 900)) }, "test \"$(grep -c abcdefghij big.txt)\" -eq 900"},
		// A quote in a path (the entries are a quoted argument).
		{func() { writeFile(t, filepath.Join(f.local, "it's é.txt"), "q\n") }, "true"},
		{func() { writeFile(t, filepath.Join(f.local, "it's é.txt"), "q'2\n") }, "grep -q \"q'2\" \"it's é.txt\""},
	}
	for i, st := range steps {
		st.change()
		out, fr, err := f.fused(st.command)
		if err != nil || !fr.Ran || fr.ExitCode != 0 {
			t.Fatalf("step %d: %q ran %v, exit %d, err %v, output %q", i, st.command, fr.Ran, fr.ExitCode, err, out)
		}
		if st.command == "cat a.txt" && out != "two\n" {
			t.Fatalf("step %d: the command saw %q", i, out)
		}
		assertTree(t, f.sandbox, syncedTree(t, f.local))
	}
	if got := string(fileBytes(t, filepath.Join(f.local, "b.txt"))); got != "b\n" {
		t.Fatalf("b.txt is %q locally", got)
	}

	// The helper fails before it answers (an older binary, a crash at its
	// start): nothing ran, and the exec takes the separate steps.
	f.breakHelperRun()
	writeFile(t, filepath.Join(f.local, "a.txt"), "four\n")
	again := againExchanges.Load()
	out, fr, err := f.fused("echo run >> count; cat a.txt")
	if err != nil || fr.Native || out != "four\n" {
		t.Fatalf("native %v, output %q, err %v", fr.Native, out, err)
	}
	if n := againExchanges.Load() - again; n != 0 {
		t.Fatalf("%d exchanges were sent again, want none (the separate steps follow)", n)
	}
	if got := f.inSandbox("cat count"); got != "run\n" {
		t.Fatalf("the command ran %q", got)
	}
}

// breakHelperRun replaces the sandbox's helper binary by one that fails at
// once, as an older binary or a crash at its start would (the server keeps
// running).
func (f *fixture) breakHelperRun() {
	f.t.Helper()
	bin := filepath.Join(f.sandbox, ".git", "sandboxd", "bin", f.r.helperName)
	if err := os.Remove(bin); err != nil {
		f.t.Fatal(err)
	}
	writeFile(f.t, bin, "#!/bin/sh\nexit 2\n")
	if err := os.Chmod(bin, 0o755); err != nil {
		f.t.Fatal(err)
	}
}

// runnerFunc is a Runner made of a function.
type runnerFunc func(ctx context.Context, command string, stdin io.Reader, stdout, stderr io.Writer) (int, error)

func (f runnerFunc) Run(ctx context.Context, command string, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	return f(ctx, command, stdin, stdout, stderr)
}

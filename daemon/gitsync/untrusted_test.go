package gitsync

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

// exchangeAsTheDaemon runs command synced as sessions.execFused does: one
// exchange with the helper, another one only when Finish says the command
// has yet to run (Again), else the separate steps.
func exchangeAsTheDaemon(t *testing.T, f *fixture, command string) (Fused, error) {
	t.Helper()
	_, fr, err := f.fused(command)
	return fr, err
}

func runs(t *testing.T, f *fixture) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(f.sandbox, "runs"))
	if err != nil {
		return 0
	}
	return strings.Count(string(b), "\n")
}

// A report of a failed push before the command started (nothing ran) is
// believed, so the exchange is sent again: here the sandbox holds the
// edits of an exec whose pull never happened.
func TestRealPushFailureStillSendsTheExchangeAgain(t *testing.T) {
	withHelper(t)
	f := newFixture(t, map[string]string{"a.txt": "a\n", ".gitignore": "runs\n"})
	f.push()
	writeFile(t, filepath.Join(f.sandbox, "left.txt"), "left by an exec never pulled\n")
	fr, err := exchangeAsTheDaemon(t, f, "echo ran >>runs")
	if err != nil || !fr.Ran {
		t.Fatalf("exec after unpulled edits: %+v, %v", fr, err)
	}
	if n := runs(t, f); n != 1 {
		t.Fatalf("the command ran %d times, want once", n)
	}
	if b := fileBytes(t, filepath.Join(f.local, "left.txt")); string(b) != "left by an exec never pulled\n" {
		t.Fatalf("the earlier exec's edits did not come back: %q", b)
	}
}

// The exec id that names a pull comes from the sandbox: a command that
// writes a path into the pending file (here with a patch over the limit,
// which is copied to a file) names no local file with it.
func TestPulledIDNamesNoLocalFile(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	f.s = newTrackedSyncer(t, Options{MaxPatchBytes: 16 << 10})
	victim := filepath.Join(filepath.Dir(f.local), "victim.patch")
	writeFile(t, victim, "the user's patch\n")
	command := `echo '/../../../../../victim' >.git/sandboxd/pending
head -c 100000 /dev/zero | tr '\0' x >big.txt`
	fr, err := exchangeAsTheDaemon(t, f, command)
	if err != nil || !fr.Ran {
		t.Fatalf("exec: %+v, %v", fr, err)
	}
	if b := fileBytes(t, victim); string(b) != "the user's patch\n" {
		t.Fatalf("a file outside the pulls directory was overwritten: %q", clip(b))
	}
	if fr.PullErr == nil {
		t.Fatalf("a pull with a forged id was taken: %+v", fr.Pull)
	}
	t.Logf("pull error: %v", fr.PullErr)
	// The next exec's push finds that exec's edits unacknowledged and sends
	// them back under the same id (the push's exit 92, "over the limit"):
	// refused there too, and the command does not run on a sandbox whose
	// edits could not be brought back.
	fr, err = exchangeAsTheDaemon(t, f, "echo ran >>runs")
	t.Logf("next exec: %+v, %v", fr, err)
	if err == nil || fr.Ran {
		t.Fatalf("the next exec ran over edits it could not bring back: %+v", fr)
	}
	if b := fileBytes(t, victim); string(b) != "the user's patch\n" {
		t.Fatalf("a file outside the pulls directory was overwritten: %q", clip(b))
	}
	ents, _ := os.ReadDir(filepath.Join(f.local, ".git", "sandboxd", "pulls"))
	for _, e := range ents {
		if strings.Contains(e.Name(), "victim") {
			t.Fatalf("a saved patch is named after the sandbox's id: %s", e.Name())
		}
	}
}

// endless is a fake sandbox whose fetch of a kept patch states size bytes
// and then sends without end, until its context ends.
type endless struct {
	id   string
	size int64
	sent int64
}

func (e *endless) Run(ctx context.Context, command string, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	if _, err := io.WriteString(stdout, pullHeader+e.id+" "+strconv.FormatInt(e.size, 10)+"\n"); err != nil {
		return -1, err
	}
	chunk := bytes.Repeat([]byte("+x\n"), 1<<12)
	for ctx.Err() == nil {
		if _, err := stdout.Write(chunk); err != nil {
			// A sandbox that ignores its stdout's end: only the context
			// stops it.
			time.Sleep(time.Millisecond)
			continue
		}
		e.sent += int64(len(chunk))
	}
	return -1, ctx.Err()
}

// The copy of a patch over the limit is bounded: a sandbox that sends
// more than it stated is stopped (the remote command's context ends) and
// nothing partial is kept; one that states more than the saved-patch bound
// is not copied at all; ids that are not the daemon's are refused.
func TestSavedPatchCopyIsBounded(t *testing.T) {
	isolate(t)
	root := t.TempDir()
	testutil.Git(t, root, "init", "-q", root)
	s := New(Options{MaxSavedPatchBytes: 1 << 20})
	ctx := context.Background()
	rp, err := s.openRepo(ctx, root)
	if err != nil {
		t.Fatal(err)
	}
	pulls := filepath.Join(rp.stateDir(), "pulls")
	e := &endless{id: "abcdef", size: 64 << 10}
	done := make(chan error, 1)
	go func() { _, err := s.fetchToFile(ctx, e, rp, e.id, e.size); done <- err }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "sent more than") {
			t.Fatalf("an endless copy: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("an endless copy was not stopped within 30 s")
	}
	if ents, _ := os.ReadDir(pulls); len(ents) != 0 {
		t.Fatalf("a partial copy was kept: %v", ents)
	}
	if _, err := s.fetchToFile(ctx, &endless{id: "abcdef", size: 2 << 20}, rp, "abcdef", 2<<20); err == nil || !strings.Contains(err.Error(), "over the 1 MiB") {
		t.Fatalf("a patch stated over the bound: %v", err)
	}
	for _, id := range []string{"/../../x", "none", "", "ABC", strings.Repeat("a", 65)} {
		if _, err := s.fetchToFile(ctx, &endless{id: id, size: 1}, rp, id, 1); err == nil {
			t.Fatalf("id %q was taken", id)
		}
	}
	// A sandbox that trickles is stopped by the copy's own deadline,
	// even under a context that never ends.
	s.saveWait = 300 * time.Millisecond
	go func() {
		_, err := s.fetchToFile(context.WithoutCancel(ctx), trickle{}, rp, "abcdef", 1<<20)
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "deadline") {
			t.Fatalf("a trickling copy: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a trickling copy was not stopped within 30 s")
	}
}

// trickle states a patch and sends a byte a while until its context ends.
type trickle struct{}

func (trickle) Run(ctx context.Context, command string, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	_, _ = io.WriteString(stdout, pullHeader+"abcdef 1048576\n")
	for {
		select {
		case <-ctx.Done():
			return -1, ctx.Err()
		case <-time.After(10 * time.Millisecond):
			_, _ = stdout.Write([]byte("x"))
		}
	}
}

// hostileEdits plants, in the sandbox, what the user's tools would run or
// misread once pulled, beside one ordinary edit (good.txt).
const hostileEdits = `mkdir -p tools/objects/ab tools/refs/heads .rwx/sandboxes
echo 'ref: refs/heads/main' >tools/HEAD
printf '[core]\n\tfsmonitor = "touch /tmp/sandboxd-pwned"\n\tworktree = .\n' >tools/config
echo x >tools/objects/ab/cd
echo 0000000000000000000000000000000000000000 >tools/refs/heads/main
ln -s /etc/passwd passwd-link
ln -s ../../.. up-link
ln -s tools/../../x up-link2
ln -s .git/config gitconfig-link
printf 'x\n' >"$(printf 'new\nline.txt')"
printf 'x\n' >"$(printf 'esc\033[2J.txt')"
echo '{"sandboxes":{}}' >.rwx/sandboxes/sandboxes.json
echo fine >good.txt
`

// hostilePaths are the paths hostileEdits makes that must not land.
var hostilePaths = []string{"tools/HEAD", "tools/config", "tools/objects/ab/cd", "tools/refs/heads/main", "passwd-link", "up-link", "up-link2",
	"gitconfig-link", "new\nline.txt", "esc\033[2J.txt", ".rwx/sandboxes/sandboxes.json"}

// Pulled content that local tools would execute or misread, and paths
// the daemon owns, are refused: not applied, kept in the saved patch and
// reported with the reason; the rest of the pull applies.
func TestPullRefusesWhatLocalToolsWouldRunOrMisread(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	_, pr, err := f.exec(hostileEdits)
	if err != nil {
		t.Fatalf("pull: %v", err)
	}
	for _, p := range hostilePaths {
		if _, err := os.Lstat(filepath.Join(f.local, p)); err == nil {
			t.Errorf("%q was applied", p)
		}
	}
	if b := fileBytes(t, filepath.Join(f.local, "good.txt")); string(b) != "fine\n" {
		t.Fatalf("the ordinary edit did not land: %q", b)
	}
	got := map[string]string{}
	for _, r := range pr.Refused {
		got[r.Path] = r.Reason
	}
	for _, p := range hostilePaths {
		if got[p] == "" {
			t.Errorf("%q is not reported as refused (refused: %v)", p, pr.Refused)
		}
	}
	if pr.SavedPatch == "" || !strings.Contains(string(fileBytes(t, pr.SavedPatch)), "fsmonitor") {
		t.Fatalf("the refused entries are not in a saved patch: %q", pr.SavedPatch)
	}
	if len(pr.Warnings) == 0 || !strings.Contains(strings.Join(pr.Warnings, "\n"), "refused") {
		t.Fatalf("the user is not told: %q", pr.Warnings)
	}
	t.Logf("warning: %s", strings.Join(pr.Warnings, "\n"))
	for _, f := range pr.Files {
		if f != "good.txt" {
			t.Errorf("the pull reports %q as applied", f)
		}
	}
}

// parsePulled never panics on what a sandbox sends, and what it cannot
// read it reports.
func FuzzParsePulled(f *testing.F) {
	f.Add([]byte("diff --git a/l b/l\nnew file mode 120000\nindex 0000000..1111111\n--- /dev/null\n+++ b/l\n@@ -0,0 +1 @@\n+/etc/passwd\n\\ No newline at end of file\n"))
	f.Add([]byte("diff --git \"a/x\\ny\" \"b/x\\ny\"\nnew file mode 100644\n--- /dev/null\n+++ \"b/x\\ny\"\n@@ -0,0 +1 @@\n+x\n"))
	f.Add([]byte("diff --git a/a b/b\nsimilarity index 100%\nrename from a\nrename to b\n"))
	f.Add([]byte("diff --git a/x b/x\n@@ -1,2 +1,2 @@\n-a\n+b\n"))
	f.Fuzz(func(t *testing.T, patch []byte) {
		entries, err := parsePulled(patch)
		if err == nil {
			_ = screenEntries(t.TempDir(), entries)
		}
	})
}

// parsePulled reads names, modes and link targets as git apply does.
func TestParsePulledReadsNamesModesAndTargets(t *testing.T) {
	patch := "diff --git a/l b/l\nnew file mode 120000\nindex 0000000..1111111\n--- /dev/null\n+++ b/l\n@@ -0,0 +1 @@\n+../x\n\\ No newline at end of file\n" +
		"diff --git \"a/x\\ny\" \"b/x\\ny\"\nnew file mode 100644\nindex 0000000..1111111\n--- /dev/null\n+++ \"b/x\\ny\"\n@@ -0,0 +1 @@\n+x\n" +
		"diff --git a/a b/b\nsimilarity index 100%\nrename from a\nrename to b\n" +
		"diff --git a/d b/d\ndeleted file mode 100644\nindex 1111111..0000000\n--- a/d\n+++ /dev/null\n@@ -1 +0,0 @@\n-d\n" +
		"diff --git a/m m b/m m\nold mode 100644\nnew mode 120000\n"
	got, err := parsePulled([]byte(patch))
	if err != nil {
		t.Fatal(err)
	}
	want := []pulledEntry{
		{new: "l", mode: "120000", target: "../x", known: true},
		{new: "x\ny", mode: "100644"},
		{old: "a", new: "b", rename: true},
		{old: "d", deleted: true},
		{old: "m m", new: "m m", mode: "120000"},
	}
	if len(got) != len(want) {
		t.Fatalf("%d entries, want %d: %+v", len(got), len(want), got)
	}
	for name, reason := range map[string]string{
		".RWX/Sandboxes/sandboxes.json": reasonDaemon, "sub/.Git/config": reasonGitPath, "x/GIT~1/HEAD": reasonGitPath,
		"ok/.gitignore": "", "a\tb": reasonControl, "caf\xe9": reasonControl,
	} {
		if got := screenEntry(t.TempDir(), pulledEntry{new: name, mode: "100644"}); got != reason {
			t.Errorf("%q: refused for %q, want %q", name, got, reason)
		}
	}
	// A git directory made of names that differ only in case, as a
	// case-insensitive file system takes them.
	var mixed []pulledEntry
	for _, n := range []string{"Tools/head", "tools/OBJECTS/x", "TOOLS/refs/y", "tools/config"} {
		mixed = append(mixed, pulledEntry{new: n, mode: "100644"})
	}
	if r := screenEntries(t.TempDir(), mixed); len(r) != 4 {
		t.Errorf("a git directory spelt in mixed case: refused %v", r)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("entry %d: %+v, want %+v", i, got[i], want[i])
		}
	}
}

// With a local git whose `git apply` has known escapes, nothing from the
// sandbox is applied: the patch is saved and the error says which git to
// install.
func TestPullRefusesToApplyWithAnUnsafeGit(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	real, err := exec.LookPath("git")
	if err != nil {
		t.Fatal(err)
	}
	fake := filepath.Join(t.TempDir(), "git")
	writeFile(t, fake, "#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'git version 2.39.2'; exit 0; fi\nexec "+real+" \"$@\"\n")
	if err := os.Chmod(fake, 0o755); err != nil {
		t.Fatal(err)
	}
	f.s = newTrackedSyncer(t, Options{Git: fake})
	_, pr, err := f.exec("echo edited >a.txt")
	if !errors.Is(err, ErrUnsafeGit) || !strings.Contains(err.Error(), "install git 2.39.3") {
		t.Fatalf("a pull with git 2.39.2: %v", err)
	}
	if b := fileBytes(t, filepath.Join(f.local, "a.txt")); string(b) != "a\n" {
		t.Fatalf("the sandbox's edit was applied with an unsafe git: %q", b)
	}
	if pr.SavedPatch == "" || !strings.Contains(string(fileBytes(t, pr.SavedPatch)), "+edited") {
		t.Fatalf("the patch was not saved: %q", pr.SavedPatch)
	}
}

// advert generates a receive-pack ref advertisement of n refs without
// holding it: pkt-lines made as they are read, the PushRef last.
type advert struct {
	n, i int
	buf  []byte
}

func (a *advert) Read(p []byte) (int, error) {
	for len(a.buf) < len(p) && a.i <= a.n {
		var line string
		switch {
		case a.i == 0:
			line = strings.Repeat("0", 40) + " capabilities^{}\x00report-status ofs-delta\n"
		case a.i == a.n:
			line = strings.Repeat("e", 40) + " " + PushRef + "\n"
		default:
			line = fmt.Sprintf("%040x refs/tags/flood-%d\n", a.i, a.i)
		}
		a.buf = fmt.Appendf(a.buf, "%04x%s", len(line)+4, line)
		a.i++
		if a.i > a.n {
			a.buf = append(a.buf, "0000"...)
		}
	}
	if len(a.buf) == 0 {
		return 0, io.EOF
	}
	n := copy(p, a.buf)
	a.buf = a.buf[n:]
	return n, nil
}

func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}

// A sandbox's ref advertisement is read into bounded memory: what the
// push needs (its ref, a bounded set of bases) is kept, not every ref;
// past the bound in refs or bytes it is refused.
func TestRefAdvertisementIsReadIntoBoundedMemory(t *testing.T) {
	n := 300_000
	if os.Getenv("SANDBOXD_TEST_LONG") != "" {
		n = maxAdvertRefs
	}
	before := heapInUse()
	adv, err := readAdvertisement(bufio.NewReader(&advert{n: n}))
	if err != nil {
		t.Fatal(err)
	}
	grew := int64(heapInUse()) - int64(before)
	runtime.KeepAlive(adv)
	t.Logf("%d refs: the heap grew by %d KiB, %d bases kept", n, grew>>10, len(adv.haves))
	if adv.pushRef != strings.Repeat("e", 40) || !adv.caps["ofs-delta"] {
		t.Fatalf("the push's ref or the capabilities were not read: %q %v", adv.pushRef, adv.caps)
	}
	if grew > 8<<20 || len(adv.haves) > maxHaves {
		t.Fatalf("%d refs kept %d bases and %d KiB of heap", n, len(adv.haves), grew>>10)
	}
	if _, err := readAdvertisement(bufio.NewReader(&advert{n: maxAdvertRefs + 10})); err == nil {
		t.Fatalf("an advertisement over the bound: %v", err)
	}
}

// What the sandbox says reaches the user's terminal without its escapes.
func TestSandboxTextShowsNoTerminalEscape(t *testing.T) {
	got := sandboxText("  fatal: \x1b]0;owned\x07\x1b[2J bad\nnext\tline\x9b " + strings.Repeat("x", 5000))
	if strings.ContainsAny(got, "\x1b\x07\u009b") || !strings.Contains(got, `\x1b]0;owned\x07`) || !strings.Contains(got, "\nnext\tline") || len(got) > maxSandboxText+64 {
		t.Fatalf("sandboxText = %q", got[:min(len(got), 200)])
	}
}

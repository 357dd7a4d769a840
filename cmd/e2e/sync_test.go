package e2e

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// treeSnapshot maps every file of a working tree (outside .git, and outside
// .rwx/sandboxes, the git-ignored bookkeeping sandboxd shares with the RWX
// CLI) to its content and mode, to compare trees byte for byte.
func treeSnapshot(t testing.TB, root string) map[string]string {
	t.Helper()
	snap := map[string]string{}
	err := filepath.Walk(root, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == ".git" || strings.HasPrefix(rel, ".git"+string(filepath.Separator)) || rel == filepath.Join(".rwx", "sandboxes") {
			if info.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if info.IsDir() {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		snap[rel] = info.Mode().String() + ":" + string(b)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return snap
}

func assertTree(t *testing.T, root string, want map[string]string) {
	t.Helper()
	got := treeSnapshot(t, root)
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: got %q, want %q", k, got[k], v)
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("unexpected file %s", k)
		}
	}
}

// TestSyncParity runs the parity scenarios of `rwx sandbox exec`, each in a
// fresh sandbox, comparing the local tree byte for byte.
func TestSyncParity(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()

	t.Run("local changes are seen in the sandbox and untouched locally", func(t *testing.T) {
		repo := e.newRepo("p1", defaultConfig)
		writeFile(t, filepath.Join(repo, "new.txt"), "brand new\n")
		writeFile(t, filepath.Join(repo, "README.md"), "edited\n")
		before := treeSnapshot(t, repo)
		r := e.mustNook(repo, "exec", "--", "sh", "-c", "cat new.txt README.md")
		if r.stdout != "brand new\nedited\n" {
			t.Fatalf("sandbox saw %q", r.stdout)
		}
		assertTree(t, repo, before)
	})

	t.Run("sandbox edits come back", func(t *testing.T) {
		repo := e.newRepo("p2", defaultConfig)
		before := treeSnapshot(t, repo)
		r := e.mustNook(repo, "exec", "--json", "--", "sh", "-c", "echo created > made.txt; echo changed > README.md")
		ej := decode[execJSON](t, r.stdout)
		want := map[string]string{}
		for k, v := range before {
			want[k] = v
		}
		want["made.txt"] = "-rw-r--r--:created\n"
		want["README.md"] = "-rw-r--r--:changed\n"
		assertTree(t, repo, want)
		if strings.Join(ej.PulledFiles, ",") == "" {
			t.Fatalf("pulled files not reported: %+v", ej)
		}
	})

	t.Run("echo hello world", func(t *testing.T) {
		repo := e.newRepo("p3", defaultConfig)
		if r := e.mustNook(repo, "exec", "--", "bash", "-c", "echo hello world"); r.stdout != "hello world\n" {
			t.Fatalf("stdout %q", r.stdout)
		}
	})

	t.Run("a file deleted locally does not come back", func(t *testing.T) {
		repo := e.newRepo("p4", defaultConfig)
		writeFile(t, filepath.Join(repo, "temp.txt"), "temp\n")
		if r := e.mustNook(repo, "exec", "--", "cat", "temp.txt"); r.stdout != "temp\n" {
			t.Fatalf("first exec saw %q", r.stdout)
		}
		os.Remove(filepath.Join(repo, "temp.txt"))
		before := treeSnapshot(t, repo)
		r := e.nook(repo, "exec", "--", "test", "-e", "temp.txt")
		if r.code != 1 {
			t.Fatalf("temp.txt still exists in the sandbox: %s", r)
		}
		assertTree(t, repo, before)
	})

	t.Run("unpushed commit and uncommitted file survive", func(t *testing.T) {
		repo := e.newRepo("p5", defaultConfig)
		e.mustNook(repo, "start", "--wait")
		writeFile(t, filepath.Join(repo, "committed.txt"), "local commit\n")
		e.git(repo, "add", "committed.txt")
		e.git(repo, "commit", "-q", "-m", "unpushed")
		writeFile(t, filepath.Join(repo, "dirty.txt"), "uncommitted\n")
		head := e.git(repo, "rev-parse", "HEAD")
		before := treeSnapshot(t, repo)
		r := e.mustNook(repo, "exec", "--", "cat", "committed.txt", "dirty.txt")
		if r.stdout != "local commit\nuncommitted\n" {
			t.Fatalf("sandbox saw %q", r.stdout)
		}
		assertTree(t, repo, before)
		if e.git(repo, "rev-parse", "HEAD") != head {
			t.Fatal("HEAD moved")
		}
		if st := e.git(repo, "status", "--porcelain"); st != "?? dirty.txt" {
			t.Fatalf("git status changed: %q", st)
		}
	})
}

func TestSyncEdgeCases(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()

	t.Run("binary rename deletion mode and odd names both ways", func(t *testing.T) {
		repo := e.newRepo("edge", defaultConfig)
		bin := []byte{0, 1, 2, 255, 254, 0, 10, 13}
		os.WriteFile(filepath.Join(repo, "blob.bin"), bin, 0o644)
		writeFile(t, filepath.Join(repo, "sp ace ünï'q.txt"), "odd name\n")
		e.git(repo, "mv", "README.md", "README2.md")
		writeFile(t, filepath.Join(repo, "run.sh"), "#!/bin/sh\necho ran\n")
		os.Chmod(filepath.Join(repo, "run.sh"), 0o755)
		r := e.mustNook(repo, "exec", "--", "sh", "-c",
			`od -An -tx1 blob.bin | tr -d ' \n'; echo; cat "sp ace ünï'q.txt"; test ! -e README.md && cat README2.md; ./run.sh;`+
				` printf '\001\000\377' > out.bin; rm README2.md; chmod +x .rwx/sandbox.yml; mv "sp ace ünï'q.txt" "renamed ü.txt"`)
		if r.stdout != "00010203fffe000a0d\nodd name\nhello\nran\n" && r.stdout != "000102fffe000a0d\nodd name\nhello\nran\n" {
			t.Fatalf("sandbox saw %q", r.stdout)
		}
		if got, _ := os.ReadFile(filepath.Join(repo, "out.bin")); !bytes.Equal(got, []byte{1, 0, 255}) {
			t.Fatalf("binary pulled as %v", got)
		}
		if _, err := os.Stat(filepath.Join(repo, "README2.md")); !os.IsNotExist(err) {
			t.Fatal("deletion in the sandbox did not come back")
		}
		if readFile(t, filepath.Join(repo, "renamed ü.txt")) != "odd name\n" {
			t.Fatal("rename in the sandbox did not come back")
		}
		if st, _ := os.Stat(filepath.Join(repo, ".rwx", "sandbox.yml")); st.Mode().Perm()&0o111 == 0 {
			t.Fatal("mode change did not come back")
		}
	})

	t.Run("no-sync leaves both sides alone", func(t *testing.T) {
		repo := e.newRepo("nosync", defaultConfig)
		writeFile(t, filepath.Join(repo, "local.txt"), "local\n")
		before := treeSnapshot(t, repo)
		if r := e.nook(repo, "exec", "--no-sync", "--", "sh", "-c", "test ! -e local.txt && echo made > made.txt"); r.code != 0 {
			t.Fatalf("--no-sync pushed the local file: %s", r)
		}
		assertTree(t, repo, before)
	})

	t.Run("conflict keeps both sides", func(t *testing.T) {
		repo := e.newRepo("conflict", defaultConfig)
		e.mustNook(repo, "start", "--wait")
		readme := filepath.Join(repo, "README.md")
		// The command edits README.md in the sandbox while the local copy
		// changes during the exec.
		cmd := e.nookCmd(repo, "exec", "--", "sh", "-c", "echo sandbox-edit > README.md; sleep 1")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(500 * time.Millisecond)
		writeFile(t, readme, "local-edit-during-exec\n")
		_ = cmd.Wait()
		if got := readFile(t, readme); !strings.Contains(got, "local-edit-during-exec") {
			t.Fatalf("the local edit was lost: %q", got)
		}
		if !strings.Contains(stderr.String(), ".rej") && !strings.Contains(stderr.String(), "patch") {
			t.Fatalf("no conflict report on stderr: %q", stderr.String())
		}
	})

	t.Run("repository without origin", func(t *testing.T) {
		repo := filepath.Join(e.root, "src", "noorigin")
		os.MkdirAll(repo, 0o755)
		e.git(repo, "init", "-q", "-b", "main")
		writeFile(t, filepath.Join(repo, ".rwx", "sandbox.yml"), defaultConfig)
		e.git(repo, "add", "-A")
		e.git(repo, "commit", "-q", "-m", "init")
		writeFile(t, filepath.Join(repo, "f.txt"), "local only\n")
		if r := e.mustNook(repo, "exec", "--", "cat", "f.txt"); r.stdout != "local only\n" {
			t.Fatalf("sandbox saw %q", r.stdout)
		}
	})

	t.Run("LFS files are named in a warning", func(t *testing.T) {
		repo := e.newRepo("lfs", defaultConfig)
		writeFile(t, filepath.Join(repo, ".gitattributes"), "*.bin filter=lfs diff=lfs merge=lfs -text\n")
		e.git(repo, "add", ".gitattributes")
		e.git(repo, "commit", "-q", "-m", "lfs")
		writeFile(t, filepath.Join(repo, "big.bin"), "pretend large\n")
		r := e.nook(repo, "exec", "--", "true")
		if !strings.Contains(r.stderr, "big.bin") || !strings.Contains(strings.ToLower(r.stderr), "lfs") {
			t.Fatalf("no LFS warning naming big.bin: %s", r)
		}
	})

	t.Run("killed exec self-heals", func(t *testing.T) {
		repo := e.newRepo("killed", defaultConfig)
		e.mustNook(repo, "start", "--wait")
		writeFile(t, filepath.Join(repo, "work.txt"), "precious\n")
		before := treeSnapshot(t, repo)
		cmd := e.nookCmd(repo, "exec", "--", "sh", "-c", "echo dirty > dirt.txt; echo ready; sleep 30")
		out, _ := cmd.StdoutPipe()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 6)
		out.Read(buf)
		cmd.Process.Signal(syscall.SIGKILL)
		cmd.Wait()
		assertTree(t, repo, before)
		r := e.mustNook(repo, "exec", "--", "sh", "-c", "test ! -e dirt.txt && cat work.txt")
		if r.stdout != "precious\n" {
			t.Fatalf("next exec did not self-heal: %s", r)
		}
		assertTree(t, repo, before)
	})
}

// TestSandboxHelperServesTheSync: on a real connection to an isolated
// sandbox the daemon installs sandboxd-helper and runs its server; from
// then on the sync goes through its native sync (see sandboxhelper), and
// what happens in the sandbox between execs is still healed or brought
// back as without it.
func TestSandboxHelperServesTheSync(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("helper", defaultConfig)
	e.mustNook(repo, "exec", "--", "true")
	// The server starts in the background after the first synced exec.
	waitUntil(t, 20*time.Second, "the helper's server", func() bool {
		r := e.nook(repo, "exec", "--no-sync", "--", "sh", "-c", "ls .git/sandboxd/helper/*.sock .git/sandboxd/bin/sandboxd-helper-*")
		return r.code == 0 && e.helperServing("")
	})
	writeFile(t, filepath.Join(repo, "local.txt"), "local\n")
	e.mustNook(repo, "exec", "--", "sh", "-c", "echo made > made.txt")
	// Between execs, something in the sandbox edits a tracked file and
	// leaves a stray one: the next synced exec brings both back first
	// (issue 30), then the sandbox is as the checkout.
	e.mustNook(repo, "exec", "--no-sync", "--", "sh", "-c", "echo sandbox > README.md; echo stray > stray.txt; rm -f .git/sandboxd/native.err")
	r := e.mustNook(repo, "exec", "--", "sh", "-c", "cat README.md local.txt made.txt stray.txt")
	if want := "sandbox\nlocal\nmade\nstray\n"; r.stdout != want {
		t.Fatalf("the sandbox's edits did not come back: %q, want %q", r.stdout, want)
	}
	if got := readFile(t, filepath.Join(repo, "README.md")) + readFile(t, filepath.Join(repo, "stray.txt")); got != "sandbox\nstray\n" {
		t.Fatalf("locally README.md and stray.txt are %q", got)
	}
	// That exec (run again once the edits came back) was the helper's
	// exchange, native: the exchange writes its messages to native.err,
	// empty when neither the native push nor the native pull declined.
	if r := e.nook(repo, "exec", "--no-sync", "--", "sh", "-c", "cat .git/sandboxd/native.err && rm .git/sandboxd/native.err"); r.code != 0 || r.stdout != "" {
		t.Fatalf("the sync did not go through the helper's native sync: %s", r)
	}
	// And the command's edits still come back.
	e.mustNook(repo, "exec", "--", "sh", "-c", "echo again >> made.txt")
	if got := readFile(t, filepath.Join(repo, "made.txt")); got != "made\nagain\n" {
		t.Fatalf("made.txt is %q", got)
	}
	// Ctrl-C reaches the command the helper runs (its exchange relays it
	// to the command's process group), and what the command changed still
	// comes back.
	e.interruptExec(t, repo, "", "echo interrupted > made.txt")
	if got := readFile(t, filepath.Join(repo, "made.txt")); got != "interrupted\n" {
		t.Fatalf("made.txt is %q after the interrupted exec", got)
	}
	// The interrupted exec was an exchange, and its pull native.
	if r := e.nook(repo, "exec", "--no-sync", "--", "sh", "-c", "cat .git/sandboxd/native.err"); r.code != 0 || r.stdout != "" {
		t.Fatalf("the interrupted exec did not go through the helper's exchange: %s", r)
	}
}

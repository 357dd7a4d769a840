package e2e

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Commits travel by git push over the daemon's kept connection, normalize
// before (not after) the command, conflicts leave .rej files.
func TestSyncPushAndNormalize(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()

	t.Run("a 50-commit unpushed history reaches the sandbox by push", func(t *testing.T) {
		repo := e.newRepo("commits", defaultConfig)
		e.mustNook(repo, "start", "--wait")
		for i := 0; i < 50; i++ {
			writeFile(t, filepath.Join(repo, fmt.Sprintf("c%02d.txt", i)), fmt.Sprintf("commit %d\n", i))
			e.git(repo, "add", "-A")
			e.git(repo, "commit", "-q", "-m", fmt.Sprintf("commit %d", i))
		}
		head := e.git(repo, "rev-parse", "HEAD")
		writeFile(t, filepath.Join(repo, "wip.txt"), "uncommitted\n")
		before := treeSnapshot(t, repo)
		r := e.mustNook(repo, "exec", "--", "sh", "-c", "git rev-parse HEAD refs/rwx/sync-push; git rev-list --count HEAD; cat c49.txt wip.txt")
		if want := head + "\n" + head + "\n51\ncommit 49\nuncommitted\n"; r.stdout != want {
			t.Fatalf("sandbox saw %q, want %q", r.stdout, want)
		}
		assertTree(t, repo, before)
		if e.git(repo, "rev-parse", "HEAD") != head {
			t.Fatal("local HEAD moved")
		}
	})

	t.Run("a generated file survives to the next exec, a deleted local file does not come back", func(t *testing.T) {
		repo := e.newRepo("normalize", defaultConfig)
		writeFile(t, filepath.Join(repo, ".gitignore"), "dist/\n")
		writeFile(t, filepath.Join(repo, "temp.txt"), "temp\n")
		e.mustNook(repo, "exec", "--", "sh", "-c", "mkdir -p dist && echo built > dist/app.js && echo gen > gen.txt")
		if readFile(t, filepath.Join(repo, "gen.txt")) != "gen\n" {
			t.Fatal("the generated file was not pulled")
		}
		if _, err := os.Stat(filepath.Join(repo, "dist")); err == nil {
			t.Fatal("ignored build output was pulled")
		}
		// Between execs the sandbox keeps what the command made (what a
		// background dev server would serve).
		if r := e.mustNook(repo, "exec", "--no-sync", "--", "cat", "dist/app.js", "gen.txt", "temp.txt"); r.stdout != "built\ngen\ntemp\n" {
			t.Fatalf("between execs the sandbox has %q", r.stdout)
		}
		os.Remove(filepath.Join(repo, "temp.txt"))
		os.Remove(filepath.Join(repo, "gen.txt"))
		before := treeSnapshot(t, repo)
		r := e.nook(repo, "exec", "--", "sh", "-c", "cat dist/app.js; test ! -e temp.txt && test ! -e gen.txt")
		if r.code != 0 || r.stdout != "built\n" {
			t.Fatalf("second exec: %s", r)
		}
		assertTree(t, repo, before)
	})

	t.Run("a conflicting pull leaves a .rej and says so", func(t *testing.T) {
		repo := e.newRepo("rej", defaultConfig)
		lines := "one\ntwo\nthree\nfour\nfive\nsix\nseven\neight\nnine\nten\neleven\ntwelve\n"
		writeFile(t, filepath.Join(repo, "f.txt"), lines)
		e.git(repo, "add", "f.txt")
		e.git(repo, "commit", "-q", "-m", "f")
		e.git(repo, "push", "-q")
		pushed := strings.Replace(lines, "one", "one (pushed)", 1)
		writeFile(t, filepath.Join(repo, "f.txt"), pushed)
		e.mustNook(repo, "start", "--wait")
		gate := filepath.Join(e.root, "rej-go")
		cmd := e.nookCmd(repo, "exec", "--json", "--", "sh", "-c",
			"sed -i -e 's/^two$/two (sandbox)/' -e 's/^eleven$/eleven (sandbox)/' f.txt; echo ready; while [ ! -e "+gate+" ]; do sleep 0.02; done")
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		var stderr strings.Builder
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		br := bufio.NewReader(out)
		if line, _ := br.ReadString('\n'); !strings.Contains(line, "ready") {
			t.Fatalf("first output %q", line)
		}
		// The user edits the same lines meanwhile, and the blobs a 3-way
		// merge would need are pruned: the hunk that conflicts goes to a
		// .rej file.
		local := strings.Replace(pushed, "two", "two (local)", 1)
		writeFile(t, filepath.Join(repo, "f.txt"), local)
		e.git(repo, "gc", "-q", "--prune=now")
		writeFile(t, gate, "go\n")
		rest := new(strings.Builder)
		_, _ = bufio.NewReader(br).WriteTo(rest)
		_ = cmd.Wait()
		if want := strings.Replace(local, "eleven", "eleven (sandbox)", 1); readFile(t, filepath.Join(repo, "f.txt")) != want {
			t.Fatalf("f.txt = %q", readFile(t, filepath.Join(repo, "f.txt")))
		}
		if rej := readFile(t, filepath.Join(repo, "f.txt.rej")); !strings.Contains(rej, "+two (sandbox)") {
			t.Fatalf("f.txt.rej = %q", rej)
		}
		// --json: the warning is a record on stdout.
		if !strings.Contains(rest.String(), `"type":"warning"`) || !strings.Contains(rest.String(), "f.txt.rej") {
			t.Fatalf("the .rej was not reported:\nstderr %s\njson %s", stderr.String(), rest.String())
		}
		// The next exec warns about it.
		if r := e.nook(repo, "exec", "--", "true"); !strings.Contains(r.stderr, "f.txt.rej") {
			t.Fatalf("next exec did not warn: %s", r)
		}
	})
}

// The daemon SIGKILLed between the command's end and the pull, or during the
// pull: the sandbox's edits are not lost; the next exec after a restart
// brings them back (or finds them already applied), says so, and then
// starts from exactly the local tree.
func TestSyncPullSurvivesDaemonKill(t *testing.T) {
	t.Parallel()
	// One user (one local remote) for all phases: only the daemon restarts.
	e := newEnv(t)
	for _, phase := range []string{"exec-after-command", "pull-before-apply", "pull-before-ack"} {
		t.Run(phase, func(t *testing.T) {
			gate := filepath.Join(e.root, "paused-"+phase)
			d := e.startDaemon("SANDBOXD_TEST_PAUSE=" + phase + ":" + gate)
			repo := e.newRepo("crash-"+phase, defaultConfig)
			writeFile(t, filepath.Join(repo, "local.txt"), "mine\n")
			cmd := e.nookCmd(repo, "exec", "--", "sh", "-c", "echo made > made.txt; echo edited > README.md; rm local.txt")
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			waitForFile(t, gate, 60*time.Second)
			d.kill()
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			select {
			case <-done:
			case <-time.After(20 * time.Second):
				_ = cmd.Process.Kill()
				<-done
				t.Log("nook did not end after the daemon was killed (a separate fix)")
			}
			if phase != "pull-before-ack" {
				if _, err := os.Stat(filepath.Join(repo, "made.txt")); err == nil {
					t.Fatal("the edits were applied before the pause")
				}
			}

			d2 := e.startDaemon()
			defer d2.stop(t)
			r := e.mustNook(repo, "exec", "--", "sh", "-c", "cat made.txt README.md; test ! -e local.txt")
			if r.stdout != "made\nedited\n" {
				t.Fatalf("the sandbox's edits did not survive: %s", r)
			}
			warned := strings.Contains(r.stderr, "never pulled")
			if phase != "pull-before-ack" && !warned {
				t.Fatalf("the recovery was not reported: %s", r)
			}
			if readFile(t, filepath.Join(repo, "made.txt")) != "made\n" || readFile(t, filepath.Join(repo, "README.md")) != "edited\n" {
				t.Fatal("the edits are not in the local tree")
			}
			if _, err := os.Stat(filepath.Join(repo, "local.txt")); err == nil {
				t.Fatal("the sandbox's deletion was not applied")
			}
			// Nothing is applied twice, and the sandbox now follows the
			// local tree again.
			os.Remove(filepath.Join(repo, "made.txt"))
			before := treeSnapshot(t, repo)
			if r := e.nook(repo, "exec", "--", "test", "!", "-e", "made.txt"); r.code != 0 || strings.Contains(r.stderr, "never pulled") {
				t.Fatalf("next exec: %s", r)
			}
			assertTree(t, repo, before)
		})
	}
}

func waitForFile(t *testing.T, path string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if _, err := os.Stat(path); err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not appear within %s", path, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// nook push syncs without running a command; nook exec --reset replaces the
// sandbox and runs in one call.
func TestPushAndExecReset(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("pushreset", defaultConfig)
	e.mustNook(repo, "start", "--wait")
	writeFile(t, filepath.Join(repo, "c.txt"), "committed\n")
	e.git(repo, "add", "c.txt")
	e.git(repo, "commit", "-q", "-m", "local")
	writeFile(t, filepath.Join(repo, "w.txt"), "wip\n")
	r := e.mustNook(repo, "push", "--json")
	j := decode[struct {
		RunID   string   `json:"runId"`
		Files   []string `json:"files"`
		Commits bool     `json:"commits"`
	}](t, r.stdout)
	if j.RunID == "" || !j.Commits || strings.Join(j.Files, ",") != "w.txt" {
		t.Fatalf("push answered %s", r.stdout)
	}
	if r := e.mustNook(repo, "exec", "--no-sync", "--", "cat", "c.txt", "w.txt"); r.stdout != "committed\nwip\n" {
		t.Fatalf("after push the sandbox has %q", r.stdout)
	}
	if r := e.mustNook(repo, "push"); !strings.Contains(r.stdout, "Pushed") {
		t.Fatalf("push said %s", r)
	}

	r = e.mustNook(repo, "exec", "--reset", "--json", "--", "cat", "w.txt")
	ex := decode[execJSON](t, r.stdout)
	if !strings.Contains(r.stdout, `"text":"wip\n"`) || ex.RunID == "" || ex.RunID == j.RunID {
		t.Fatalf("exec --reset: %s (first run %s)", r, j.RunID)
	}
	l := decode[listJSON](t, e.mustNook(repo, "list", "--json").stdout)
	active := 0
	for _, s := range l.Sessions {
		if s.Status == "ready" || s.Status == "starting" {
			active++
		}
	}
	if active != 1 {
		t.Fatalf("%d active sandboxes after exec --reset: %+v", active, l.Sessions)
	}
}

package agent

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/crypto/ssh"
)

// git's SSH transport commands are served for the workspace's checkout, and
// only for it.
func TestGitServicesForTheCheckout(t *testing.T) {
	f := start(t)
	if out, err := exec.Command("git", "init", "-q", f.dir).CombinedOutput(); err != nil {
		t.Fatalf("git init: %v: %s", err, out)
	}
	if out, err := exec.Command("git", "-C", f.dir, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "a").CombinedOutput(); err != nil {
		t.Fatalf("git commit: %v: %s", err, out)
	}
	c := f.dial(t)
	for _, cmd := range []string{"git-upload-pack '.'", "git-receive-pack '.'", "git upload-pack '" + f.dir + "'"} {
		out, errOut, code := run(t, c, cmd, "0000")
		if code != 0 || !strings.Contains(out, "refs/heads/") {
			t.Fatalf("%s: exit %d, out %q, err %q", cmd, code, out, errOut)
		}
	}
	for _, cmd := range []string{"git-receive-pack '/etc'", "git-upload-pack '../'"} {
		_, errOut, code := run(t, c, cmd, "0000")
		if code == 0 || !strings.Contains(errOut, "outside the sandbox's checkout") {
			t.Fatalf("%s: exit %d, err %q", cmd, code, errOut)
		}
	}
	// A quoted path stays one word: no shell injection.
	if _, _, code := run(t, c, `git-upload-pack 'a'\''; touch x'`, "0000"); code == 0 {
		t.Fatal("a missing repository was served")
	}
	if _, err := os.Stat(filepath.Join(f.dir, "x")); err == nil {
		t.Fatal("the path ran as a shell command")
	}
}

// Sync markers sent without waiting for an answer still hide exactly the
// commands sent between them from the run's log.
func TestSyncMarkersWithoutReply(t *testing.T) {
	f := start(t)
	var log syncBuffer
	f.agent.cfg.RunLog = &log
	c := f.dial(t)
	fire := func(command string) {
		ch, reqs, err := c.OpenChannel("session", nil)
		if err != nil {
			t.Fatal(err)
		}
		go ssh.DiscardRequests(reqs)
		if _, err := ch.SendRequest("exec", false, ssh.Marshal(struct{ Command string }{command})); err != nil {
			t.Fatal(err)
		}
		go func() { _, _ = ch.Read(make([]byte, 1)); ch.Close() }()
	}
	for i := 0; i < 20; i++ {
		fire(DirectiveSyncStart)
		run(t, c, "echo plumbing", "")
		fire(DirectiveSyncEnd)
		run(t, c, "echo user", "")
	}
	got := log.String()
	if strings.Contains(got, "plumbing") || strings.Count(got, "echo user") != 20 {
		t.Fatalf("run log:\n%s", got)
	}
}

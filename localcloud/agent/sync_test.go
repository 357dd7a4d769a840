package agent

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/crypto/ssh"

	"github.com/sandboxd/sandboxd/internal/testutil"
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
	var log testutil.LockedBuffer
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

// `git push` over OpenSSH, as the RWX CLI sends it (user@host:., so the
// agent gets `git-receive-pack '.'`), reaches the sandbox's checkout.
func TestGitPushOverOpenSSH(t *testing.T) {
	testutil.NeedTool(t, "ssh", "apt-get install openssh-client")
	_, hostPriv, _ := ed25519.GenerateKey(rand.Reader)
	_, userPriv, _ := ed25519.GenerateKey(rand.Reader)
	host, _ := ssh.NewSignerFromKey(hostPriv)
	user, _ := ssh.NewSignerFromKey(userPriv)
	dir, work := t.TempDir(), t.TempDir()
	gitIn := func(d string, args ...string) string {
		t.Helper()
		cmd := exec.Command("git", append([]string{"-c", "user.name=t", "-c", "user.email=t@t"}, args...)...)
		cmd.Dir = d
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("git %v: %v: %s", args, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	gitIn(dir, "init", "-q", ".")
	gitIn(dir, "commit", "-q", "--allow-empty", "-m", "base")
	gitIn(work, "clone", "-q", dir, ".")
	gitIn(work, "commit", "-q", "--allow-empty", "-m", "local")
	head := gitIn(work, "rev-parse", "HEAD")
	a, err := Start(Config{HostKey: host, AuthorizedKey: user.PublicKey(), Workspace: dir,
		Env: []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + dir}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	keyBlock, err := ssh.MarshalPrivateKey(userPriv, "")
	if err != nil {
		t.Fatal(err)
	}
	key, known := filepath.Join(work, ".git", "key"), filepath.Join(work, ".git", "known")
	if err := os.WriteFile(key, pem.EncodeToMemory(keyBlock), 0o600); err != nil {
		t.Fatal(err)
	}
	hostName, port, _ := net.SplitHostPort(a.Addr())
	if err := os.WriteFile(known, []byte("sandbox "+string(ssh.MarshalAuthorizedKey(host.PublicKey()))), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("git", "push", User+"@sandbox:.", "+"+head+":refs/rwx/sync-push")
	cmd.Dir = work
	cmd.Env = append(os.Environ(), "GIT_SSH_COMMAND=ssh -F /dev/null -i "+key+" -o BatchMode=yes -o IdentitiesOnly=yes -o StrictHostKeyChecking=yes -o UserKnownHostsFile="+known+" -o HostKeyAlias=sandbox -o HostName="+hostName+" -p "+port)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("git push: %v: %s", err, out)
	}
	if got := gitIn(dir, "rev-parse", "refs/rwx/sync-push"); got != head {
		t.Fatalf("the sandbox has %q, want %s", got, head)
	}
}

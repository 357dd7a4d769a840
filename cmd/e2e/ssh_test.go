package e2e

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/localcloud/agent"
)

// sshRun runs an OpenSSH program (ssh, scp, rsync) with the test's
// environment, no terminal and no stdin: a prompt would fail it.
func (e *env) sshRun(t *testing.T, dir, bin string, args ...string) result {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	cmd.Env = e.vars
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	if err != nil {
		ee, ok := err.(*exec.ExitError)
		if !ok {
			t.Fatalf("run %s %v: %v", bin, args, err)
		}
		code = ee.ExitCode()
	}
	return result{code: code, stdout: out.String(), stderr: errb.String()}
}

// TestOpenSSHThroughTheDaemon: `nook ssh-config` gives the real OpenSSH
// client a host per live sandbox whose ProxyCommand carries the stream over
// the daemon, with the pinned host key and the run's key (files 0600), so
// ssh, scp (SFTP and classic), sftp and rsync work with no prompt; a wrong host key is refused; an
// unknown host name is a clear error.
func TestOpenSSHThroughTheDaemon(t *testing.T) {
	t.Parallel()
	sshBin := needTool(t, "ssh", "apt-get install openssh-client")
	scpBin := needTool(t, "scp", "apt-get install openssh-client")
	sftpBin := needTool(t, "sftp", "apt-get install openssh-client")
	rsyncBin := needTool(t, "rsync", "apt-get install rsync")
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("sshrepo", defaultConfig)
	e.mustNook(repo, "start", "--wait")

	r := e.mustNook(repo, "ssh-config")
	cfg := filepath.Join(e.root, "ssh.config")
	writeFile(t, cfg, r.stdout)
	m := regexp.MustCompile(`(?m)^Host (nook-sshrepo-main) `).FindStringSubmatch(r.stdout)
	if m == nil {
		t.Fatalf("no host for the sandbox in:\n%s", r.stdout)
	}
	host := m[1]
	for _, k := range []string{"IdentityFile", "UserKnownHostsFile"} {
		f := regexp.MustCompile(`(?m)^\s+` + k + ` (\S+)$`).FindStringSubmatch(r.stdout)
		if f == nil {
			t.Fatalf("no %s in:\n%s", k, r.stdout)
		}
		st, err := os.Stat(f[1])
		if err != nil || st.Mode().Perm() != 0o600 {
			t.Fatalf("%s %s: %v, mode %v (want 0600)", k, f[1], err, st.Mode())
		}
	}

	r = e.sshRun(t, e.root, sshBin, "-F", cfg, host, "echo $((6*7)); cat README.md; exit 3")
	if r.code != 3 || r.stdout != "42\nhello\n" {
		t.Fatalf("ssh: %s", r)
	}

	// scp: today's default protocol (SFTP, the agent's sftp subsystem
	// running OpenSSH's sftp-server in the sandbox) and the classic one
	// (-O, over a command).
	writeFile(t, filepath.Join(e.root, "up.txt"), "uploaded with scp\n")
	if sftpServerInstalled() {
		if r := e.sshRun(t, e.root, scpBin, "-F", cfg, "up.txt", host+":up.txt"); r.code != 0 {
			t.Fatalf("scp up: %s", r)
		}
		if r := e.sshRun(t, e.root, scpBin, "-F", cfg, host+":up.txt", "down.txt"); r.code != 0 || readFile(t, filepath.Join(e.root, "down.txt")) != "uploaded with scp\n" {
			t.Fatalf("scp down: %s", r)
		}
		// sftp in batch mode: relative paths are the checkout's.
		writeFile(t, filepath.Join(e.root, "batch"), "put up.txt via-sftp.txt\nls -1\nget README.md readme-via-sftp\n")
		if r := e.sshRun(t, e.root, sftpBin, "-F", cfg, "-b", "batch", host); r.code != 0 || !strings.Contains(r.stdout, "via-sftp.txt") ||
			readFile(t, filepath.Join(e.root, "readme-via-sftp")) != "hello\n" {
			t.Fatalf("sftp -b: %s", r)
		}
		if r := e.sshRun(t, e.root, sshBin, "-F", cfg, host, "cat via-sftp.txt"); r.stdout != "uploaded with scp\n" {
			t.Fatalf("the file sftp put is not in the checkout: %s", r)
		}
	} else {
		if inCI() {
			t.Fatal("OpenSSH's sftp-server is not installed, and CI=true: .ci/run must install openssh-sftp-server")
		}
		t.Log("OpenSSH's sftp-server is not installed (apt-get install openssh-sftp-server): scp over SFTP only checked for its clear error")
		if r := e.sshRun(t, e.root, scpBin, "-F", cfg, "up.txt", host+":up.txt"); r.code == 0 || !strings.Contains(r.stderr, "openssh-sftp-server") {
			t.Fatalf("scp without sftp-server in the sandbox: want a failure naming openssh-sftp-server: %s", r)
		}
	}
	if r := e.sshRun(t, e.root, scpBin, "-O", "-F", cfg, "up.txt", host+":up-classic.txt"); r.code != 0 {
		t.Fatalf("scp -O up: %s", r)
	}
	if r := e.sshRun(t, e.root, scpBin, "-O", "-F", cfg, host+":up-classic.txt", "down-classic.txt"); r.code != 0 || readFile(t, filepath.Join(e.root, "down-classic.txt")) != "uploaded with scp\n" {
		t.Fatalf("scp -O down: %s", r)
	}

	// rsync both ways.
	writeFile(t, filepath.Join(e.root, "tree", "a.txt"), "a\n")
	writeFile(t, filepath.Join(e.root, "tree", "sub", "b.txt"), "b\n")
	rsh := "ssh -F " + cfg
	if r := e.sshRun(t, e.root, rsyncBin, "-a", "-e", rsh, "tree/", host+":tree/"); r.code != 0 {
		t.Fatalf("rsync up: %s", r)
	}
	if r := e.sshRun(t, e.root, rsyncBin, "-a", "-e", rsh, host+":tree/", "back/"); r.code != 0 || readFile(t, filepath.Join(e.root, "back", "sub", "b.txt")) != "b\n" {
		t.Fatalf("rsync down: %s", r)
	}

	// The host key is pinned: another key is refused, never prompted for.
	kh := regexp.MustCompile(`(?m)^\s+UserKnownHostsFile (\S+)$`).FindStringSubmatch(readFile(t, cfg))[1]
	pinned := readFile(t, kh)
	alias := strings.Fields(pinned)[0]
	other := alias + " ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAxQ8wAUvVmIH0eU0j6zM0y+hpPdjLqSUl8RBCIbEGuV\n"
	if err := os.WriteFile(kh, []byte(other), 0o600); err != nil {
		t.Fatal(err)
	}
	if r := e.sshRun(t, e.root, sshBin, "-F", cfg, host, "true"); r.code != 255 || !strings.Contains(r.stderr, "HOST IDENTIFICATION HAS CHANGED") && !strings.Contains(r.stderr, "verification failed") {
		t.Fatalf("ssh with a wrong pinned key: %s", r)
	}
	// ssh-config writes the pinned key again.
	e.mustNook(repo, "ssh-config")
	if readFile(t, kh) != pinned {
		t.Fatal("nook ssh-config did not restore the pinned host key")
	}

	if r := e.nook(e.root, "proxy", "--stdio", "nook-nothing-here"); r.code != 125 || !strings.Contains(r.stderr, "nook ssh-config") {
		t.Fatalf("proxy to an unknown host: %s", r)
	}
}

// sftpServerInstalled says whether OpenSSH's sftp-server is where the
// local remote's sandboxes (which see this machine's /usr) look for it.
func sftpServerInstalled() bool {
	for _, p := range agent.DefaultSFTPServers {
		if st, err := os.Stat(p); err == nil && st.Mode()&0o111 != 0 {
			return true
		}
	}
	return false
}

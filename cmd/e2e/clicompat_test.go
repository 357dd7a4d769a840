package e2e

import (
	"encoding/json"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"
)

// connInfo is what the local remote answers for a sandboxable run.
type connInfo struct {
	Address        string `json:"address"`
	PublicHostKey  string `json:"public_host_key"`
	PrivateUserKey string `json:"private_user_key"`
}

func (lc *localcloud) connInfo(t testing.TB, run string) connInfo {
	t.Helper()
	var ci connInfo
	if err := json.Unmarshal(lc.call(t, "GET", "/mint/api/sandbox_connection_info?sandbox_key="+run, nil), &ci); err != nil {
		t.Fatal(err)
	}
	return ci
}

// sshConfig is how the RWX CLI logs in: user, the run's key, pinned host key.
func sshConfig(t testing.TB, ci connInfo, user string, key ssh.Signer) *ssh.ClientConfig {
	t.Helper()
	host, _, _, _, err := ssh.ParseAuthorizedKey([]byte(ci.PublicHostKey))
	if err != nil {
		t.Fatal(err)
	}
	return &ssh.ClientConfig{User: user, Auth: []ssh.AuthMethod{ssh.PublicKeys(key)}, HostKeyCallback: ssh.FixedHostKey(host), Timeout: 10 * time.Second}
}

// TestSSHUsersOfTheRWXCLI: a sandbox of the local remote takes today's RWX
// CLI login (rwx-cli) and the older one (mint-cli), each only with the run's
// own key; sandboxd itself works with it (its exec ran).
func TestSSHUsersOfTheRWXCLI(t *testing.T) {
	e := newEnv(t)
	lc := e.startLocalcloud()
	e.startDaemon()
	repo := e.newRepo("users", defaultConfig)
	run := e.startSandbox(repo)
	e.mustSbx(repo, "exec", "--no-sync", "--", "true")
	ci := lc.connInfo(t, run)
	key, err := ssh.ParsePrivateKey([]byte(ci.PrivateUserKey))
	if err != nil {
		t.Fatal(err)
	}
	other := e.startSandbox(e.newRepo("users-other", defaultConfig))
	otherKey, err := ssh.ParsePrivateKey([]byte(lc.connInfo(t, other).PrivateUserKey))
	if err != nil {
		t.Fatal(err)
	}
	for _, user := range []string{"rwx-cli", "mint-cli"} {
		c, err := ssh.Dial("tcp", ci.Address, sshConfig(t, ci, user, key))
		if err != nil {
			t.Fatalf("%s with the run's key: %v", user, err)
		}
		sess, err := c.NewSession()
		if err != nil {
			t.Fatal(err)
		}
		out, err := sess.Output("echo in-sandbox")
		c.Close()
		if err != nil || string(out) != "in-sandbox\n" {
			t.Fatalf("%s: exec gave %q, %v", user, out, err)
		}
		// Another run's key is a wrong key here.
		if c, err := ssh.Dial("tcp", ci.Address, sshConfig(t, ci, user, otherKey)); err == nil {
			c.Close()
			t.Fatalf("%s with another run's key was accepted", user)
		}
	}
}

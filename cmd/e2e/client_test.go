package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestAutostartVersionAndStop: with no daemon running, nook starts one in
// the background (logging to the state directory), versions match, and
// `nook daemon stop` ends it; with autostart off, nook says how to start it.
func TestAutostartVersionAndStop(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	if r := e.nook(e.root, "version"); r.code != 125 || !strings.Contains(r.stderr, "SANDBOXD_NO_AUTOSTART") {
		t.Fatalf("with autostart off: %s", r)
	}
	e.vars = append(e.vars, "SANDBOXD_NO_AUTOSTART=")
	t.Cleanup(func() {
		// The autostarted daemon is not a child of the test: stop it by pid.
		pidFile := filepath.Join(e.get("XDG_STATE_HOME"), "sandboxd", "sandboxd.pid")
		if b, err := os.ReadFile(pidFile); err == nil {
			if pid, err := strconv.Atoi(strings.SplitN(string(b), "\n", 2)[0]); err == nil && pid > 0 {
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	})
	r := e.mustNook(e.root, "version", "--json")
	v := decode[struct {
		Client   struct{ Version string } `json:"client"`
		Daemon   struct{ Version string } `json:"daemon"`
		Mismatch bool                     `json:"mismatch"`
	}](t, r.stdout)
	if v.Daemon.Version == "" || v.Mismatch || v.Client.Version != v.Daemon.Version {
		t.Fatalf("versions: %s", r)
	}
	if _, err := os.Stat(filepath.Join(e.get("XDG_STATE_HOME"), "sandboxd", "sandboxd.log")); err != nil {
		t.Fatalf("the autostarted daemon has no log file: %v", err)
	}
	e.mustNook(e.root, "daemon", "stop")
	waitUntil(t, 10*time.Second, "the daemon to stop", func() bool {
		_, err := os.Stat(e.socket())
		return os.IsNotExist(err)
	})
	if r := e.nook(e.root, "daemon", "status"); r.code == 0 {
		t.Fatalf("daemon status after stop: %s", r)
	}
}

// TestConfigNeverShowsTheToken: `nook config` names the remote and where the
// token comes from, never the token itself.
func TestConfigNeverShowsTheToken(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const secret = "rwx-secret-token-value"
	e.vars = append(e.vars, "RWX_ACCESS_TOKEN="+secret, "SANDBOXD_REMOTE=rwx", "RWX_HOST=cloud.example.invalid")
	e.startDaemon()
	for _, args := range [][]string{{"config"}, {"config", "--json"}} {
		r := e.mustNook(e.root, args...)
		if strings.Contains(r.stdout+r.stderr, secret) {
			t.Fatalf("nook %v shows the token: %s", args, r)
		}
		if !strings.Contains(r.stdout, "rwx") || !strings.Contains(r.stdout, "cloud.example.invalid") || !strings.Contains(r.stdout, "RWX_ACCESS_TOKEN") {
			t.Fatalf("nook %v does not describe the remote: %s", args, r)
		}
	}
}

// TestConfigFileChangeReloads: saving sandboxd's config file reloads it, as
// SIGHUP does.
func TestConfigFileChangeReloads(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.writeConfig(map[string]any{"reconcile_interval": "30s"})
	e.startDaemon()
	interval := func() float64 {
		return decode[struct {
			Seconds float64 `json:"reconcileIntervalSeconds"`
		}](t, e.mustNook(e.root, "config", "--json").stdout).Seconds
	}
	if got := interval(); got != 30 {
		t.Fatalf("interval %v, want 30", got)
	}
	e.writeConfig(map[string]any{"reconcile_interval": "7s"})
	waitUntil(t, 10*time.Second, "the config change to apply", func() bool { return interval() == 7 })
}

// TestCorruptDatabaseIsReportedAndKept: a database that cannot be read
// stops the daemon with a message naming the file, which is left as it was.
func TestCorruptDatabaseIsReportedAndKept(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	db := filepath.Join(e.get("XDG_STATE_HOME"), "sandboxd", "sandboxd.db")
	garbage := strings.Repeat("not a bbolt file ", 1000)
	writeFile(t, db, garbage)
	cmd := exec.Command(filepath.Join(binDir, "sandboxd"))
	cmd.Env = e.vars
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("sandboxd started on a corrupt database:\n%s", out)
	}
	if !strings.Contains(string(out), db) {
		t.Fatalf("the error does not name the database file:\n%s", out)
	}
	if readFile(t, db) != garbage {
		t.Fatal("the corrupt database was changed")
	}
	// nook, starting the daemon itself, shows the daemon's own error.
	e.vars = append(e.vars, "SANDBOXD_NO_AUTOSTART=")
	if r := e.nook(e.root, "version"); r.code != 125 || !strings.Contains(r.stderr, db) {
		t.Fatalf("nook autostart on a corrupt database: %s", r)
	}
}

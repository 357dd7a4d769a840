package e2e

import (
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

type expiryListJSON struct {
	Sessions []struct {
		RunID          string     `json:"runId"`
		ExpiresAt      *time.Time `json:"expiresAt"`
		ExpiryPulledAt *time.Time `json:"expiryPulledAt"`
	} `json:"sessions"`
}

// TestEditsMadeOverSSHComeBackBeforeTheRunExpires: the local remote
// reports when a run ends (its maximum lifetime, here 75s); the daemon
// pulls pull_before_expiry (35s) ahead of it, with no exec, so an edit made
// over ssh is in the checkout before the run is gone. nook list and status
// say when it expires and that it was pulled; an edit made after that pull
// still comes back with the next exec.
func TestEditsMadeOverSSHComeBackBeforeTheRunExpires(t *testing.T) {
	t.Parallel()
	sshBin := needTool(t, "ssh", "apt-get install openssh-client")
	const lifetime, lead = 75 * time.Second, 35 * time.Second
	e := newEnv(t)
	e.startLocalcloud("--max-lifetime", lifetime.String())
	e.writeConfig(map[string]any{"pull_before_expiry": lead.String()})
	e.startDaemon()
	repo := e.newRepo("expiry", defaultConfig)
	run := e.startSandbox(repo)
	e.mustNook(repo, "exec", "--", "true")
	events := e.followEvents("")

	r := e.mustNook(repo, "ssh-config")
	cfg := filepath.Join(e.root, "ssh.config")
	writeFile(t, cfg, r.stdout)
	m := regexp.MustCompile(`(?m)^Host (nook-expiry-main) `).FindStringSubmatch(r.stdout)
	if m == nil {
		t.Fatalf("no host for the sandbox in:\n%s", r.stdout)
	}
	host := m[1]
	if r := e.sshRun(t, e.root, sshBin, "-F", cfg, host, "echo 'edited over ssh' >> README.md"); r.code != 0 {
		t.Fatalf("ssh edit: %s", r)
	}
	var expires time.Time
	for _, s := range decode[expiryListJSON](t, e.mustNook(repo, "list", "--json").stdout).Sessions {
		if s.RunID == run && s.ExpiresAt != nil {
			expires = *s.ExpiresAt
		}
	}
	if expires.IsZero() {
		t.Fatalf("nook list --json reports no expiresAt for %s", run)
	}
	if time.Until(expires) <= lead {
		t.Fatalf("the setup took too long: the edit was made %s before the run's end, inside the %s lead", time.Until(expires).Round(time.Second), lead)
	}
	if got := readFile(t, filepath.Join(repo, "README.md")); got != "hello\n" {
		t.Fatalf("README.md came back before the pull: %q", got)
	}

	events.waitFor(t, time.Until(expires), "session.expiring before the run ends", runEvent("session.expiring", run))
	if got := readFile(t, filepath.Join(repo, "README.md")); got != "hello\nedited over ssh\n" {
		t.Fatalf("after the pull before expiry, local README.md = %q", got)
	}
	if left := time.Until(expires); left <= 0 {
		t.Fatalf("the edit came back %s after the run ended", -left)
	}
	var pulled bool
	for _, s := range decode[expiryListJSON](t, e.mustNook(repo, "list", "--json").stdout).Sessions {
		pulled = pulled || (s.RunID == run && s.ExpiryPulledAt != nil)
	}
	if !pulled {
		t.Fatal("nook list --json does not say the edits were pulled ahead of the end")
	}
	if r := e.mustNook(repo, "list"); !strings.Contains(r.stdout, "EXPIRES") || !strings.Contains(r.stdout, "(pulled)") {
		t.Fatalf("nook list does not show the expiry and the pull: %s", r)
	}
	if r := e.mustNook(repo, "status"); !strings.Contains(r.stdout, "its edits pulled ahead at") {
		t.Fatalf("nook status does not say the edits were pulled ahead: %s", r)
	}

	// An edit after the pull comes back with the next exec, as usual.
	if r := e.sshRun(t, e.root, sshBin, "-F", cfg, host, "echo later > later.txt"); r.code != 0 {
		t.Fatalf("ssh edit: %s", r)
	}
	e.mustNook(repo, "exec", "--", "true")
	if got := readFile(t, filepath.Join(repo, "later.txt")); got != "later\n" {
		t.Fatalf("an edit made after the pull before expiry did not come back with the next exec: %q", got)
	}
}

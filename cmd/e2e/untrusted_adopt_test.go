package e2e

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/rwxapi"
)

// TestForeignRunInTheCLIFileIsNotAdopted: a sandbox can write the RWX CLI's
// .rwx/sandboxes/sandboxes.json of the checkout (a pull brings it back, or
// the command writes it). Written as an attacker would, naming a run of
// another checkout (new key format) or of another branch (old
// cwd:branch:config format) with a scoped token, it is not adopted: the
// daemon says why, the user's next exec runs in a sandbox of its own, and
// the uncommitted file it syncs never reaches the foreign run.
func TestForeignRunInTheCLIFileIsNotAdopted(t *testing.T) {
	e := newEnv(t)
	lc := e.startLocalcloud()
	// The reconcile loop would adopt the foreign runs as what their
	// cli_state says (their own checkout, branch): that is right, but the
	// file's claim would then name a known run and prove nothing.
	e.writeConfig(map[string]any{"reconcile_interval": "1h"})
	e.startDaemon()
	cli := e.fakeCLI(lc)
	victim := e.newRepo("victim", defaultConfig)
	attacker := e.newRepo("attacker", defaultConfig)
	cfg := filepath.Join(victim, ".rwx", "sandbox.yml")

	// Runs the daemon does not know: one the RWX CLI started in another
	// checkout, one it started on another branch of this checkout.
	foreign := cliRun(t, cli, attacker, "main")
	e.git(victim, "checkout", "-q", "-b", "feature")
	otherBranch := cliRun(t, cli, victim, "feature")
	e.git(victim, "checkout", "-q", "main")

	cases := []struct {
		name, branch, run, file string
	}{
		{"another checkout's run under a branch:config key", "main", foreign,
			`{"version":1,"sandboxes":{"main:` + cfg + `":{"runId":"` + foreign + `","configFile":"` + cfg + `","scopedToken":"forged"}}}`},
		{"another branch's run under a cwd:branch:config key", "dev", otherBranch,
			`{"sandboxes":{"` + victim + `:dev:.rwx/sandbox.yml":{"runId":"` + otherBranch + `","configFile":".rwx/sandbox.yml","scopedToken":"forged"}}}`},
	}
	for _, c := range cases {
		if c.branch != "main" {
			e.git(victim, "checkout", "-q", "-b", c.branch)
		}
		events := e.followEvents("")
		// The daemon has seen the checkout: its watch reads the file.
		e.sbx(victim, "status")
		writeFile(t, cliStoragePath(victim), c.file)
		secret := "secret-" + c.branch + ".env"
		writeFile(t, filepath.Join(victim, secret), "TOKEN=user-secret\n")
		ej := decode[execJSON](t, e.mustSbx(victim, "exec", "--json", "--", "cat", secret).stdout)
		if ej.RunID == c.run || ej.RunID == foreign || ej.RunID == otherBranch {
			t.Fatalf("%s: the exec ran in the foreign run %s", c.name, ej.RunID)
		}
		// The foreign run never saw the file (looked at without syncing).
		e.mustSbx(attacker, "start", "--wait", "--id", c.run)
		if r := e.sbx(attacker, "exec", "--no-sync", "--id", c.run, "--", "sh", "-c", "test ! -e "+secret); r.code != 0 {
			t.Fatalf("%s: the foreign run %s holds %s: %s", c.name, c.run, secret, r)
		}
		ev := events.waitFor(t, 20*time.Second, "adoption refused", func(ev map[string]any) bool {
			return ev["type"] == "session.adoption_refused" && ev["runId"] == c.run
		})
		if data, _ := ev["data"].(map[string]any); data["reason"] == "" || data["reason"] == nil {
			t.Fatalf("%s: the refusal says no reason: %v", c.name, ev)
		}
		events.stop()
	}
}

// cliRun starts a run of repo's branch as the RWX CLI does (cli_state with
// the absolute config path), without sandboxd.
func cliRun(t *testing.T, cli *fakeCLI, repo, branch string) string {
	t.Helper()
	cfg := filepath.Join(repo, ".rwx", "sandbox.yml")
	config := readFile(t, cfg)
	res, err := cli.api.CreateRun(context.Background(), rwxapi.RunDefinition{
		Title:           "Sandbox: " + filepath.Base(repo) + " (" + branch + ")",
		CLIState:        rwxapi.CLIState{Branch: branch, ConfigFile: cfg}.Encode(),
		Git:             rwxapi.GitMetadata{Branch: branch, Sha: cli.e.git(repo, "rev-parse", "HEAD"), OriginURL: repo},
		TaskDefinitions: []rwxapi.DirectoryEntry{{Path: ".rwx/sandbox.yml", Type: "file", Permissions: 0o644, FileContents: config}},
		MintDirectory:   []rwxapi.DirectoryEntry{{Path: "sandbox.yml", Type: "file", Permissions: 0o644, FileContents: config}},
		UseCache:        true,
	}, "")
	if err != nil {
		t.Fatal(err)
	}
	return res.RunID
}

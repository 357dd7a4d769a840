package e2e

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/sandboxd/sandboxd/daemon/runsapi"
	"github.com/sandboxd/sandboxd/rwxapi"
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
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	e.startDaemon()
	repo := e.newRepo("users", defaultConfig)
	run := e.startSandbox(repo)
	e.mustNook(repo, "exec", "--no-sync", "--", "true")
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

// fakeCLI is a second client that keeps its state exactly as the RWX CLI
// (rwx-cloud/rwx, 2026-08) does: `.rwx/sandboxes/sandboxes.json` with
// "branch:/absolute/config" keys, rewritten through a temporary file under
// an flock of sandboxes.json.lock, and cli_state {"branch","configFile"}
// with an absolute configFile. It is written here from the CLI's documented
// behaviour, independently of sandboxd's own writer, so a format drift on
// either side shows. The runs API is spoken with the project's client.
type fakeCLI struct {
	t   testing.TB
	e   *env
	api *runsapi.Client
}

// cliRecord and cliStorage are the CLI's SandboxSession and SandboxStorage.
type cliRecord struct {
	RunID         string     `json:"runId"`
	ConfigFile    string     `json:"configFile"`
	ScopedToken   string     `json:"scopedToken,omitempty"`
	RunURL        string     `json:"runUrl,omitempty"`
	ConfigHash    string     `json:"configHash,omitempty"`
	CreatedAt     *time.Time `json:"createdAt,omitempty"`
	LastExecAt    *time.Time `json:"lastExecAt,omitempty"`
	ExecCount     int        `json:"execCount,omitempty"`
	ResetNagShown bool       `json:"resetNagShown,omitempty"`
}

type cliStorage struct {
	Version   int                  `json:"version,omitempty"`
	Sandboxes map[string]cliRecord `json:"sandboxes"`
}

func (e *env) fakeCLI(lc *localcloud) *fakeCLI {
	e.t.Helper()
	c, err := runsapi.New(runsapi.Options{BaseURL: lc.apiURL, Token: lc.token, HTTPClient: lc.client, UserAgent: "fake-rwx-cli"})
	if err != nil {
		e.t.Fatal(err)
	}
	return &fakeCLI{t: e.t, e: e, api: c}
}

func cliStoragePath(repo string) string {
	return filepath.Join(repo, ".rwx", "sandboxes", "sandboxes.json")
}

// lock takes the CLI's lock (blocking flock, as gofrs/flock's Lock).
func (c *fakeCLI) lock(repo string) func() {
	c.t.Helper()
	os.MkdirAll(filepath.Dir(cliStoragePath(repo)), 0o755)
	f, err := os.OpenFile(cliStoragePath(repo)+".lock", os.O_CREATE|os.O_RDONLY, 0o600)
	if err != nil {
		c.t.Fatal(err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		c.t.Fatal(err)
	}
	return func() { syscall.Flock(int(f.Fd()), syscall.LOCK_UN); f.Close() }
}

func (c *fakeCLI) load(repo string) cliStorage {
	c.t.Helper()
	st := cliStorage{Version: 1, Sandboxes: map[string]cliRecord{}}
	b, err := os.ReadFile(cliStoragePath(repo))
	if errors.Is(err, os.ErrNotExist) {
		return st
	}
	if err != nil {
		c.t.Fatal(err)
	}
	if err := json.Unmarshal(b, &st); err != nil {
		c.t.Fatalf("the CLI cannot parse sandboxes.json: %v\n%s", err, b)
	}
	if st.Sandboxes == nil {
		st.Sandboxes = map[string]cliRecord{}
	}
	return st
}

func (c *fakeCLI) save(repo string, st cliStorage) {
	c.t.Helper()
	st.Version = 1
	dir := filepath.Dir(cliStoragePath(repo))
	tmp, err := os.CreateTemp(dir, ".sandboxes-*.json.tmp")
	if err != nil {
		c.t.Fatal(err)
	}
	enc := json.NewEncoder(tmp)
	enc.SetIndent("", "  ")
	if err := enc.Encode(st); err != nil {
		c.t.Fatal(err)
	}
	tmp.Close()
	if err := os.Rename(tmp.Name(), cliStoragePath(repo)); err != nil {
		c.t.Fatal(err)
	}
}

// sessionKey is the CLI's key; it panics on a relative config, as the CLI.
func sessionKey(branch, cfg string) string {
	if !filepath.IsAbs(cfg) {
		panic("SessionKey called with relative configFile: " + cfg)
	}
	return branch + ":" + cfg
}

// alive is the CLI's liveness test of a run.
func (c *fakeCLI) alive(run string) bool {
	ci, err := c.api.ConnectionInfo(context.Background(), run, "")
	return err == nil && (ci.Sandboxable || !ci.Polling.Completed)
}

// execRun resolves the sandbox of repo the way `rwx sandbox exec` without a
// config argument does, creating one if none is found, and says how it found
// it: "file" (a record of the branch in sandboxes.json), "remote" (a listed
// run whose cli_state names this branch and config) or "created".
func (c *fakeCLI) execRun(repo string) (run, how string) {
	c.t.Helper()
	ctx := context.Background()
	branch := c.e.git(repo, "rev-parse", "--abbrev-ref", "HEAD")
	cfg := filepath.Join(repo, ".rwx", "sandbox.yml") // the nearest .rwx + sandbox.yml, absolute
	unlock := c.lock(repo)
	defer unlock()
	st := c.load(repo)
	var active []cliRecord
	for key, rec := range st.Sandboxes {
		if strings.HasPrefix(key, branch+":") {
			if c.alive(rec.RunID) {
				active = append(active, rec)
			} else {
				delete(st.Sandboxes, key)
			}
		}
	}
	c.save(repo, st)
	switch len(active) {
	case 1:
		return active[0].RunID, "file"
	case 0:
	default:
		c.t.Fatalf("the CLI finds %d active sandboxes for branch %s: %+v", len(active), branch, active)
	}
	runs, err := c.api.ListSandboxes(ctx)
	if err != nil {
		c.t.Fatal(err)
	}
	for _, r := range runs {
		if r.CLIState == "" {
			continue
		}
		cs, err := rwxapi.DecodeCLIState(r.CLIState)
		if err != nil {
			continue
		}
		if cs.Branch == branch && cs.ConfigFile == cfg && c.alive(r.ID) {
			st.Sandboxes[sessionKey(branch, cfg)] = cliRecord{RunID: r.ID, ConfigFile: cfg, RunURL: r.RunURL}
			c.save(repo, st)
			return r.ID, "remote"
		}
	}
	config := readFile(c.t, cfg)
	res, err := c.api.CreateRun(ctx, rwxapi.RunDefinition{
		Title:           "Sandbox: " + filepath.Base(repo) + " (" + branch + ")",
		CLIState:        base64.StdEncoding.EncodeToString([]byte(`{"branch":"` + branch + `","configFile":"` + cfg + `"}`)),
		Git:             rwxapi.GitMetadata{Branch: branch, Sha: c.e.git(repo, "rev-parse", "HEAD"), OriginURL: repo},
		TaskDefinitions: []rwxapi.DirectoryEntry{{Path: ".rwx/sandbox.yml", Type: "file", Permissions: 0o644, FileContents: config}},
		MintDirectory:   []rwxapi.DirectoryEntry{{Path: "sandbox.yml", Type: "file", Permissions: 0o644, FileContents: config}},
		UseCache:        true,
	}, "")
	if err != nil {
		c.t.Fatal(err)
	}
	now := time.Now().UTC()
	st.Sandboxes[sessionKey(branch, cfg)] = cliRecord{RunID: res.RunID, ConfigFile: cfg, RunURL: res.RunURL, CreatedAt: &now}
	c.save(repo, st)
	return res.RunID, "created"
}

// list is `rwx sandbox list`: every listed run with a cli_state is keyed
// by it (the CLI panics on a relative configFile).
func (c *fakeCLI) list() {
	c.t.Helper()
	runs, err := c.api.ListSandboxes(context.Background())
	if err != nil {
		c.t.Fatal(err)
	}
	for _, r := range runs {
		cs, err := rwxapi.DecodeCLIState(r.CLIState)
		if err != nil {
			continue
		}
		func() {
			defer func() {
				if p := recover(); p != nil {
					c.t.Fatalf("`rwx sandbox list` would panic on run %s: %v", r.ID, p)
				}
			}()
			sessionKey(cs.Branch, cs.ConfigFile)
		}()
	}
}

// sshRun runs command in run as the CLI does (user rwx-cli, the run's key).
func (c *fakeCLI) sshRun(lc *localcloud, run, command string) string {
	c.t.Helper()
	waitUntil(c.t, 60*time.Second, "run "+run+" to be sandboxable", func() bool {
		ci, err := c.api.ConnectionInfo(context.Background(), run, "")
		return err == nil && ci.Sandboxable
	})
	ci := lc.connInfo(c.t, run)
	key, err := ssh.ParsePrivateKey([]byte(ci.PrivateUserKey))
	if err != nil {
		c.t.Fatal(err)
	}
	cl, err := ssh.Dial("tcp", ci.Address, sshConfig(c.t, ci, "rwx-cli", key))
	if err != nil {
		c.t.Fatal(err)
	}
	defer cl.Close()
	sess, err := cl.NewSession()
	if err != nil {
		c.t.Fatal(err)
	}
	out, err := sess.Output(command)
	if err != nil {
		c.t.Fatalf("%s in %s: %v", command, run, err)
	}
	return string(out)
}

// TestSharingWithTheRWXCLINookFirst: a sandbox nook started is the one the
// CLI uses in the same checkout, found through sandboxes.json and, without
// that record, through its cli_state; `rwx sandbox list` would not panic on
// it; stopping it with nook removes sandboxd's record and keeps the CLI's own.
func TestSharingWithTheRWXCLINookFirst(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	e.startDaemon()
	cli := e.fakeCLI(lc)
	repo := e.newRepo("nookfirst", defaultConfig)
	// A record of the CLI that sandboxd must keep as it is.
	other := "/elsewhere/.rwx/sandbox.yml"
	writeFile(t, cliStoragePath(repo), `{"version":1,"sandboxes":{"dev:`+other+`":{"runId":"cli-own","configFile":"`+other+`","scopedToken":"secret","execCount":3,"futureField":"x"}}}`)

	run := e.startSandbox(repo)
	if raw := readFile(t, cliStoragePath(repo)); !strings.Contains(raw, `"futureField": "x"`) || !strings.HasPrefix(raw, "{\n  \"version\": 1,\n  \"sandboxes\": {\n") {
		t.Fatalf("sandboxd's rewrite lost a field of the CLI's record or left the CLI's format:\n%s", raw)
	}
	cli.list()
	if got, how := cli.execRun(repo); got != run || how != "file" {
		t.Fatalf("the CLI used run %s (%s), want nook's %s from sandboxes.json", got, how, run)
	}
	if out := cli.sshRun(lc, run, "echo shared"); out != "shared\n" {
		t.Fatalf("the CLI's command in the shared sandbox said %q", out)
	}
	st := cli.load(repo)
	rec := st.Sandboxes[sessionKey("main", filepath.Join(repo, ".rwx", "sandbox.yml"))]
	if rec.RunID != run || rec.RunURL == "" || rec.ConfigHash == "" || rec.CreatedAt == nil || rec.ScopedToken != "" {
		t.Fatalf("sandboxd's record = %+v", rec)
	}
	// The CLI's lookup by cli_state alone (its record lost).
	unlock := cli.lock(repo)
	delete(st.Sandboxes, sessionKey("main", filepath.Join(repo, ".rwx", "sandbox.yml")))
	cli.save(repo, st)
	unlock()
	if got, how := cli.execRun(repo); got != run || how != "remote" {
		t.Fatalf("the CLI used run %s (%s), want nook's %s from its cli_state", got, how, run)
	}
	if ej := decode[execJSON](t, e.mustNook(repo, "exec", "--no-sync", "--json", "--", "true").stdout); ej.RunID != run {
		t.Fatalf("nook moved to run %s", ej.RunID)
	}

	e.mustNook(repo, "stop")
	waitUntil(t, 10*time.Second, "sandboxd to remove its record", func() bool {
		return len(cli.load(repo).Sandboxes) == 1
	})
	st = cli.load(repo)
	if r, ok := st.Sandboxes["dev:"+other]; !ok || r.ScopedToken != "secret" || r.RunID != "cli-own" || r.ExecCount != 3 {
		t.Fatalf("the CLI's own record was changed: %+v", st)
	}
}

// TestSharingWithTheRWXCLICLIFirst: a sandbox the CLI started (its run and
// its record) is adopted by the running daemon as soon as the CLI writes
// sandboxes.json, shows in `nook list`, and is the one nook execs in.
func TestSharingWithTheRWXCLICLIFirst(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	e.startDaemon()
	cli := e.fakeCLI(lc)
	repo := e.newRepo("clifirst", defaultConfig)
	// nook has seen the checkout (and has no sandbox there).
	if r := e.nook(repo, "status"); !strings.Contains(r.stdout+r.stderr, "no_sandbox") && !strings.Contains(r.stderr, "no sandbox") {
		t.Fatalf("status before any sandbox: %s", r)
	}
	events := e.followEvents("")
	run, how := cli.execRun(repo)
	if how != "created" {
		t.Fatalf("the CLI found a sandbox (%s) in a new checkout", how)
	}
	events.waitFor(t, 20*time.Second, "adoption from sandboxes.json", func(ev map[string]any) bool {
		data, _ := ev["data"].(map[string]any)
		return ev["type"] == "session.adopted" && ev["runId"] == run && data["from"] == "rwx-cli"
	})
	lj := decode[listJSON](t, e.mustNook(repo, "list", "--json").stdout)
	if len(lj.Sessions) != 1 || lj.Sessions[0].RunID != run || lj.Sessions[0].Branch != "main" {
		t.Fatalf("nook list = %+v, want the CLI's run %s", lj, run)
	}
	if ej := decode[execJSON](t, e.mustNook(repo, "exec", "--no-sync", "--json", "--", "true").stdout); ej.RunID != run {
		t.Fatalf("nook exec ran in %s, want the CLI's run %s", ej.RunID, run)
	}
	// Synced both ways, although sandboxd did not create the run (its base
	// is learned from the sandbox).
	writeFile(t, filepath.Join(repo, "local.txt"), "from the laptop\n")
	out := e.mustNook(repo, "exec", "--", "sh", "-c", "cat local.txt; echo from the sandbox > made.txt; basename $(dirname $PWD)").stdout
	if out != "from the laptop\n"+run+"\n" {
		t.Fatalf("synced exec in the CLI's run said %q", out)
	}
	if got := readFile(t, filepath.Join(repo, "made.txt")); got != "from the sandbox\n" {
		t.Fatalf("the sandbox's file came back as %q", got)
	}
	if got, how := cli.execRun(repo); got != run || how != "file" {
		t.Fatalf("the CLI moved to %s (%s)", got, how)
	}
}

// TestSharingWithTheRWXCLIAtOnce: nook and the CLI resolving the sandbox of a
// fresh checkout at the same moment end up on one run: both take the CLI's
// lock before looking and creating.
func TestSharingWithTheRWXCLIAtOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lc := e.startLocalcloud()
	e.startDaemon()
	cli := e.fakeCLI(lc)
	for i := range 3 {
		repo := e.newRepo(fmt.Sprintf("atonce%d", i), defaultConfig)
		var nookRun string
		done := make(chan struct{})
		go func() {
			defer close(done)
			r := e.nook(repo, "start", "--json")
			if r.code != 0 {
				t.Errorf("nook start: %s", r)
				return
			}
			nookRun = decode[startJSON](t, r.stdout).Session.RunID
		}()
		cliRun, _ := cli.execRun(repo)
		<-done
		if nookRun != cliRun {
			t.Fatalf("round %d: nook is on %s, the CLI on %s", i, nookRun, cliRun)
		}
	}
}

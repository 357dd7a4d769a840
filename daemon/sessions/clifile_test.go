package sessions

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/clifile"
	"github.com/sandboxd/sandboxd/daemon/runsapi"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/rwxapi"
	"github.com/sandboxd/sandboxd/store"
)

// claimsRemote is a runs API listing runs with the cli_state the test
// gives them; sandboxed runs show in the list of sandboxes, the others only
// among the runs in progress. It records the token of every call.
type claimsRemote struct {
	mu sync.Mutex
	// inProgressDown makes the list of runs in progress answer 500.
	inProgressDown bool
	sandboxed      map[string]rwxapi.CLIState
	starting       map[string]rwxapi.CLIState
	tokens         []string
}

func (c *claimsRemote) serve(t *testing.T) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.tokens = append(c.tokens, r.Header.Get("Authorization"))
		if r.URL.Path != rwxapi.PathRuns {
			http.NotFound(w, r)
			return
		}
		if c.inProgressDown && r.URL.Query().Get(rwxapi.QueryResultStatus) == "" {
			w.WriteHeader(http.StatusInternalServerError)
			json.NewEncoder(w).Encode(map[string]string{"error": "down"})
			return
		}
		res := rwxapi.ListRunsResult{Runs: []rwxapi.RunSummary{}}
		add := func(runs map[string]rwxapi.CLIState) {
			for id, cs := range runs {
				res.Runs = append(res.Runs, rwxapi.RunSummary{ID: id, CLIState: cs.Encode()})
			}
		}
		add(c.sandboxed)
		if r.URL.Query().Get(rwxapi.QueryResultStatus) == "" {
			add(c.starting)
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(res)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// refusals records the adoption refusals published.
type refusals struct {
	mu   sync.Mutex
	runs map[string]string // run id -> reason
}

func (r *refusals) Publish(typ, sessionID, runID string, data any) ipc.Event {
	if typ == eventAdoptionRefused {
		r.mu.Lock()
		r.runs[runID] = data.(map[string]string)["reason"]
		r.mu.Unlock()
	}
	return ipc.Event{}
}

// TestCLIFileRunsAreAdoptedOnlyWhenTheRemoteConfirmsThem: the RWX CLI's
// file lives in the working tree, where a pull could write it. Of the runs
// it names, only those the remote lists (asked with the daemon's own token)
// with a cli_state naming this checkout, branch and config are adopted, in
// both key formats; the others are refused with a reason, and the file's
// scoped token is never kept.
func TestCLIFileRunsAreAdoptedOnlyWhenTheRemoteConfirmsThem(t *testing.T) {
	repo, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(t.TempDir(), "other")
	mkdirs(t, filepath.Join(repo, ".git"), filepath.Join(other, ".git"))
	cfg := filepath.Join(repo, ".rwx", "sandbox.yml")
	touch(t, cfg, "tasks: []\n")
	touch(t, filepath.Join(other, ".rwx", "sandbox.yml"), "tasks: []\n")
	otherCfg := filepath.Join(other, ".rwx", "sandbox.yml")

	api := &claimsRemote{
		sandboxed: map[string]rwxapi.CLIState{
			"foreign-checkout": {Branch: "main", ConfigFile: otherCfg},
			"foreign-nook":     {Branch: "old", ConfigFile: otherCfg, RepoRoot: other, ConfigRel: ".rwx/sandbox.yml"},
			"foreign-branch":   {Branch: "elsewhere", ConfigFile: cfg},
			"relative":         {Branch: "rel", ConfigFile: ".rwx/sandbox.yml"},
			"legit":            {Branch: "feature", ConfigFile: cfg},
		},
		starting: map[string]rwxapi.CLIState{"legit-starting": {Branch: "starting", ConfigFile: cfg}},
	}
	client, err := runsapi.New(runsapi.Options{BaseURL: api.serve(t), Token: "daemon-token", Timeout: 5 * time.Second, MaxRetries: -1})
	if err != nil {
		t.Fatal(err)
	}
	st, err := store.Open(context.Background(), filepath.Join(t.TempDir(), "sandboxd.db"), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	ev := &refusals{runs: map[string]string{}}
	m, err := New(Options{Store: st, Remotes: fakeSource{client}, Pool: nopPool{}, Sync: nopSync{}, Events: ev, Branches: fixedBranch{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		m.Close(ctx)
	})

	rec := func(run string) map[string]any {
		return map[string]any{"runId": run, "configFile": cfg, "scopedToken": "token-of-" + run}
	}
	// Version 0: the old cwd:branch:config keys are read as such.
	file := map[string]any{"sandboxes": map[string]any{
		"main:" + cfg:                       rec("foreign-checkout"),
		repo + ":old:.rwx/sandbox.yml":      rec("foreign-nook"),
		"elsewhere:" + cfg:                  map[string]any{"runId": "foreign-branch-claimed-as-main", "configFile": cfg},
		"dev:" + cfg:                        rec("foreign-branch"),
		"rel:" + cfg:                        rec("relative"),
		"gone:" + cfg:                       rec("not-listed"),
		"feature:" + cfg:                    rec("legit"),
		repo + ":starting:.rwx/sandbox.yml": rec("legit-starting"),
	}}
	raw, _ := json.Marshal(file)
	touch(t, clifile.Path(repo), string(raw))

	adopted, err := m.readCLIFile(context.Background(), repo)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]*store.Session{}
	for _, s := range adopted {
		got[s.RunID] = s
	}
	if len(got) != 2 || got["legit"] == nil || got["legit-starting"] == nil {
		t.Fatalf("adopted %v, want only the runs the remote confirms (legit, legit-starting)", keys(got))
	}
	for _, s := range adopted {
		if s.Token != "" {
			t.Errorf("run %s was adopted with the file's scoped token", s.RunID)
		}
		if want := map[string]string{"legit": "feature", "legit-starting": "starting"}[s.RunID]; s.Branch != want || s.ConfigFile != cfg || s.RepoRoot != repo {
			t.Errorf("run %s adopted as %+v", s.RunID, s.Identity)
		}
	}
	for _, run := range []string{"foreign-checkout", "foreign-nook", "foreign-branch", "relative", "not-listed", "foreign-branch-claimed-as-main"} {
		if _, err := st.ByRunID(run); err == nil {
			t.Errorf("run %s was adopted", run)
		}
		if ev.runs[run] == "" {
			t.Errorf("no refusal was published for run %s", run)
		}
	}
	api.mu.Lock()
	for _, tok := range api.tokens {
		if tok != "Bearer daemon-token" {
			t.Errorf("the remote was asked with %q, want the daemon's own token", tok)
		}
	}
	asked := len(api.tokens)
	api.mu.Unlock()
	if asked == 0 {
		t.Fatal("the remote was never asked")
	}
	// A refused record is not asked about again.
	if again, err := m.readCLIFile(context.Background(), repo); err != nil || len(again) != 0 {
		t.Fatalf("second read: %v, %v", again, err)
	}
	api.mu.Lock()
	defer api.mu.Unlock()
	if len(api.tokens) != asked {
		t.Errorf("the second read asked the remote %d more times for records refused already", len(api.tokens)-asked)
	}
}

// TestCLIFileAdoptsNothingWhenTheRemoteDoesNotAnswer: no confirmation, no
// adoption.
func TestCLIFileAdoptsNothingWhenTheRemoteDoesNotAnswer(t *testing.T) {
	api := newFakeRemoteAPI(t)
	api.srv.Close()
	m, st := newTestManager(t, api, time.Second)
	repo, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	mkdirs(t, filepath.Join(repo, ".git"))
	cfg := filepath.Join(repo, ".rwx", "sandbox.yml")
	touch(t, cfg, "tasks: []\n")
	touch(t, clifile.Path(repo), `{"version":1,"sandboxes":{"main:`+cfg+`":{"runId":"r1","configFile":"`+cfg+`","scopedToken":"t"}}}`)
	adopted, err := m.readCLIFile(context.Background(), repo)
	if err == nil || len(adopted) != 0 {
		t.Fatalf("readCLIFile = %v, %v; want an error and nothing adopted", adopted, err)
	}
	if _, err := st.ByRunID("r1"); err == nil {
		t.Fatal("run r1 was adopted without the remote's word")
	}
	if _, err := os.Stat(clifile.Path(repo)); err != nil {
		t.Fatal(err)
	}
}

func keys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// TestCLIFileConfirmsWhatItCanWhenTheSecondListFails: a remote that lists
// sandboxes but fails the list of runs in progress still confirms the
// sandboxes; a provisioning run stays unconfirmed (not adopted, not
// refused for good) and is asked about again at the next read.
func TestCLIFileConfirmsWhatItCanWhenTheSecondListFails(t *testing.T) {
	repo, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	mkdirs(t, filepath.Join(repo, ".git"))
	cfg := filepath.Join(repo, ".rwx", "sandbox.yml")
	touch(t, cfg, "tasks: []\n")
	api := &claimsRemote{
		inProgressDown: true,
		sandboxed:      map[string]rwxapi.CLIState{"ready": {Branch: "main", ConfigFile: cfg}},
		starting:       map[string]rwxapi.CLIState{"starting": {Branch: "dev", ConfigFile: cfg}},
	}
	client, err := runsapi.New(runsapi.Options{BaseURL: api.serve(t), Token: "daemon-token", Timeout: 5 * time.Second, MaxRetries: -1})
	if err != nil {
		t.Fatal(err)
	}
	st, err := store.Open(context.Background(), filepath.Join(t.TempDir(), "sandboxd.db"), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	ev := &refusals{runs: map[string]string{}}
	m, err := New(Options{Store: st, Remotes: fakeSource{client}, Pool: nopPool{}, Sync: nopSync{}, Events: ev, Branches: fixedBranch{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close(context.Background()) })
	touch(t, clifile.Path(repo), `{"version":1,"sandboxes":{"main:`+cfg+`":{"runId":"ready"},"dev:`+cfg+`":{"runId":"starting"}}}`)
	adopted, err := m.readCLIFile(context.Background(), repo)
	if err != nil || len(adopted) != 1 || adopted[0].RunID != "ready" {
		t.Fatalf("first read: %v, %v; want the listed sandbox adopted", adopted, err)
	}
	if len(ev.runs) != 0 {
		t.Fatalf("refused %v although the remote could not say", ev.runs)
	}
	api.mu.Lock()
	api.inProgressDown = false
	api.mu.Unlock()
	adopted, err = m.readCLIFile(context.Background(), repo)
	if err != nil || len(adopted) != 1 || adopted[0].RunID != "starting" {
		t.Fatalf("second read: %v, %v; want the provisioning run adopted once the remote answers", adopted, err)
	}
}

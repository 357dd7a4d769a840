package store

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

func writeLegacy(t *testing.T, repo, content string) string {
	t.Helper()
	path := filepath.Join(repo, ".rwx", "sandboxes", "sandboxes.json")
	must(t, os.MkdirAll(filepath.Dir(path), 0o755))
	must(t, os.WriteFile(path, []byte(content), 0o644))
	return path
}

func TestReadLegacyFileBothKeyFormats(t *testing.T) {
	repo := isolate(t)
	created := time.Date(2025, 3, 1, 10, 0, 0, 0, time.UTC)

	// Version 0 (no version field): the RWX CLI's old cwd:branch:config
	// keys, with an absolute and a relative config, next to a
	// branch:config key that must not be mistaken for an old one.
	oldPath := writeLegacy(t, repo, `{"sandboxes":{
	  "`+repo+`:main:`+repo+`/.rwx/sandbox.yml": {"runId":"run-old","configFile":"`+repo+`/.rwx/sandbox.yml","scopedToken":"tok","runUrl":"https://cloud/runs/run-old","configHash":"abc","createdAt":"2025-03-01T10:00:00Z","lastExecAt":"2025-03-01T11:00:00Z","execCount":3},
	  "`+repo+`/sub:feature/x:.rwx/other.yml": {"runId":"run-rel","configFile":".rwx/other.yml"},
	  "dev:`+repo+`/.rwx/sandbox.yml": {"runId":"run-new0","configFile":"`+repo+`/.rwx/sandbox.yml"}
	}}`)
	got, err := ReadLegacyFile(oldPath)
	must(t, err)
	want := map[string]LegacySession{
		"run-old":  {Cwd: repo, Branch: "main", ConfigFile: repo + "/.rwx/sandbox.yml", RunID: "run-old", ScopedToken: "tok", RunURL: "https://cloud/runs/run-old", ConfigHash: "abc", CreatedAt: created, LastExecAt: created.Add(time.Hour), ExecCount: 3},
		"run-rel":  {Cwd: repo + "/sub", Branch: "feature/x", ConfigFile: repo + "/sub/.rwx/other.yml", RunID: "run-rel"},
		"run-new0": {Branch: "dev", ConfigFile: repo + "/.rwx/sandbox.yml", RunID: "run-new0"},
	}
	checkLegacy(t, got, want)

	// Version 1: branch:config keys only, including a detached HEAD, an
	// empty branch and a key with no config (the record's is used).
	newPath := writeLegacy(t, repo, `{"version":1,"sandboxes":{
	  "main:`+repo+`/.rwx/sandbox.yml": {"runId":"run-a","configFile":"`+repo+`/.rwx/sandbox.yml","createdAt":"2025-03-01T10:00:00Z"},
	  "detached@abc1234:`+repo+`/.rwx/sandbox.yml": {"runId":"run-b"},
	  ":`+repo+`/x.yml": {"runId":"run-c"},
	  "topic:": {"runId":"run-d","configFile":".rwx/sandbox.yml"}
	}}`)
	got, err = ReadLegacyFile(newPath)
	must(t, err)
	checkLegacy(t, got, map[string]LegacySession{
		"run-a": {Branch: "main", ConfigFile: repo + "/.rwx/sandbox.yml", RunID: "run-a", CreatedAt: created},
		"run-b": {Branch: "detached@abc1234", ConfigFile: repo + "/.rwx/sandbox.yml", RunID: "run-b"},
		"run-c": {Branch: "detached", ConfigFile: repo + "/x.yml", RunID: "run-c"},
		"run-d": {Branch: "topic", ConfigFile: ".rwx/sandbox.yml", RunID: "run-d"},
	})
}

func checkLegacy(t *testing.T, got []LegacySession, want map[string]LegacySession) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%d legacy sessions, want %d: %+v", len(got), len(want), got)
	}
	for i, g := range got {
		if i > 0 && got[i-1].Key >= g.Key {
			t.Errorf("not sorted by key: %q before %q", got[i-1].Key, g.Key)
		}
		w, ok := want[g.RunID]
		if !ok {
			t.Errorf("unexpected %+v", g)
			continue
		}
		w.Key = g.Key
		if g != w {
			t.Errorf("run %s:\n got %+v\nwant %+v", g.RunID, g, w)
		}
	}
}

func TestReadLegacyFileErrors(t *testing.T) {
	repo := isolate(t)
	if _, err := ReadLegacyFile(filepath.Join(repo, "missing.json")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing file: err = %v, want ErrNotExist", err)
	}
	for _, content := range []string{`{"sandboxes":`, `{"sandboxes":{"main:/x.yml":{"runId":7}}}`, `[]`} {
		path := writeLegacy(t, repo, content)
		_, err := ReadLegacyFile(path)
		if !errors.Is(err, ErrLegacyMalformed) || !strings.Contains(err.Error(), path) {
			t.Fatalf("content %s: err = %v, want ErrLegacyMalformed naming %s", content, err, path)
		}
	}
}

func TestAdoptLegacyWithoutClobbering(t *testing.T) {
	s, clock := newTestStore(t)
	repo := "/src/repo"
	toIdentity := func(l LegacySession) (Identity, bool) {
		if l.Branch == "rejected" {
			return Identity{}, false
		}
		cfg := l.ConfigFile
		if !filepath.IsAbs(cfg) {
			cfg = filepath.Join(repo, cfg)
		}
		return Identity{RepoRoot: repo, Branch: l.Branch, ConfigFile: cfg}, true
	}
	// A live session sandboxd already has for "main", a known run, and an
	// ended one.
	existing := &Session{Identity: ident("main"), RunID: "run-main-nook", State: StateReady}
	must(t, s.Insert(existing))
	must(t, s.Insert(&Session{Identity: ident("known"), RunID: "run-known", State: StateReady}))
	must(t, s.Insert(&Session{Identity: ident("gone"), RunID: "run-gone", State: StateExpired}))

	created := time.Date(2025, 3, 1, 10, 0, 0, 0, time.UTC)
	legacy := []LegacySession{
		{Branch: "main", ConfigFile: repo + "/.rwx/sandbox.yml", RunID: "run-main-cli"}, // identity taken
		{Branch: "other", ConfigFile: repo + "/.rwx/sandbox.yml", RunID: "run-known"},   // run taken
		{Branch: "gone", ConfigFile: repo + "/.rwx/sandbox.yml", RunID: "run-gone"},     // run ended: never again
		{Branch: "feature", ConfigFile: ".rwx/sandbox.yml", RunID: "run-f", ScopedToken: "tok", RunURL: "u", ConfigHash: "h", CreatedAt: created, LastExecAt: created.Add(time.Minute), ExecCount: 4},
		{Branch: "feature2", ConfigFile: repo + "/.rwx/sandbox.yml", RunID: "run-f"}, // same run twice in the file
		{Branch: "norun", ConfigFile: repo + "/.rwx/sandbox.yml"},                    // nothing to adopt
		{Branch: "rejected", ConfigFile: repo + "/.rwx/sandbox.yml", RunID: "run-r"}, // toIdentity says no
		{Branch: "detached@abc", ConfigFile: repo + "/.rwx/sandbox.yml", RunID: "run-d"},
	}
	got, err := s.AdoptLegacy(legacy, toIdentity, "cloud.rwx.com")
	must(t, err)
	if len(got) != 2 || got[0].RunID != "run-f" || got[1].RunID != "run-d" {
		t.Fatalf("adopted %+v, want run-f and run-d", got)
	}
	mustVerify(t, s)

	f, err := s.ByRunID("run-f")
	must(t, err)
	want := Session{
		ID: f.ID, Identity: ident("feature"), Remote: "cloud.rwx.com", RunID: "run-f", RunURL: "u", Token: "tok", ConfigHash: "h",
		State: StateUnknown, StateReason: f.StateReason, CreatedAt: created, UpdatedAt: clock.Now(), LastExecAt: created.Add(time.Minute), ExecCount: 4, Adopted: true,
	}
	if !reflect.DeepEqual(*f, want) || f.StateReason == "" {
		t.Fatalf("adopted session:\n got %+v\nwant %+v", f, &want)
	}
	if d, err := s.ByIdentity(ident("detached@abc")); err != nil || d.RunID != "run-d" || !d.CreatedAt.Equal(clock.Now()) {
		t.Fatalf("ByIdentity(detached) = %+v, %v", d, err)
	}
	if m, _ := s.ByIdentity(ident("main")); m.ID != existing.ID {
		t.Fatal("the adoption replaced sandboxd's own session")
	}
	for _, run := range []string{"run-main-cli", "run-r"} {
		if _, err := s.ByRunID(run); !errors.Is(err, ErrNotFound) {
			t.Fatalf("%s was adopted", run)
		}
	}
	if g, _ := s.ByRunID("run-gone"); g.State != StateExpired {
		t.Fatal("an ended run came back")
	}

	// The file changed: only what is new is adopted.
	legacy = append(legacy, LegacySession{Branch: "late", ConfigFile: repo + "/.rwx/sandbox.yml", RunID: "run-late"})
	got, err = s.AdoptLegacy(legacy, toIdentity, "cloud.rwx.com")
	if err != nil || len(got) != 1 || got[0].RunID != "run-late" {
		t.Fatalf("second read adopted %+v, %v; want run-late only", got, err)
	}
	if c, _ := s.Count(); c != 6 {
		t.Fatalf("Count = %d after adoptions, want 6", c)
	}
}

// The whole path as the daemon runs it: a file of the RWX CLI in a repo.
func TestAdoptLegacyFromFile(t *testing.T) {
	s, _ := newTestStore(t)
	repo := t.TempDir()
	path := writeLegacy(t, repo, `{"sandboxes":{"`+repo+`:main:.rwx/sandbox.yml":{"runId":"run-1","configFile":".rwx/sandbox.yml"}},"version":0}`)
	ls, err := ReadLegacyFile(path)
	must(t, err)
	adopted, err := s.AdoptLegacy(ls, func(l LegacySession) (Identity, bool) {
		return Identity{RepoRoot: repo, Branch: l.Branch, ConfigFile: l.ConfigFile}, true
	}, "local")
	must(t, err)
	if len(adopted) != 1 {
		t.Fatalf("adopted %d", len(adopted))
	}
	got, err := s.ByIdentity(Identity{RepoRoot: repo, Branch: "main", ConfigFile: filepath.Join(repo, ".rwx", "sandbox.yml")})
	if err != nil || got.RunID != "run-1" {
		t.Fatalf("ByIdentity = %+v, %v", got, err)
	}
}

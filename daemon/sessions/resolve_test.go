package sessions

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/rwxapi"

	"github.com/sandboxd/sandboxd/daemon/repofile"
	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/store"
)

func mkdirs(t *testing.T, paths ...string) {
	t.Helper()
	for _, p := range paths {
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

func touch(t *testing.T, path, content string) {
	t.Helper()
	mkdirs(t, filepath.Dir(path))
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestFindRepoRootWalksUpToDotGit(t *testing.T) {
	root := t.TempDir()
	mkdirs(t, filepath.Join(root, ".git"), filepath.Join(root, "a", "b"))
	if got, err := findRepoRoot(filepath.Join(root, "a", "b")); err != nil || got != root {
		t.Fatalf("findRepoRoot = %q, %v", got, err)
	}
	// A worktree has a .git file.
	wt := t.TempDir()
	touch(t, filepath.Join(wt, ".git"), "gitdir: /elsewhere\n")
	if got, err := findRepoRoot(wt); err != nil || got != wt {
		t.Fatalf("worktree: %q, %v", got, err)
	}
	outside := t.TempDir()
	if _, err := findRepoRoot(outside); !errors.Is(err, errdefs.ErrInvalid) || strings.Contains(err.Error(), "--id") || !strings.Contains(withIDHint(err).Error(), "--id") {
		t.Fatalf("outside a repository: %v", err)
	}
}

func TestFindConfig(t *testing.T) {
	root := t.TempDir()
	sub := filepath.Join(root, "svc", "api")
	mkdirs(t, sub)
	def := filepath.Join(root, ".rwx", "sandbox.yml")
	if got, _ := findConfig(sub, root, ""); got != def {
		t.Fatalf("no config anywhere: %q, want the default %q", got, def)
	}
	touch(t, def, "x")
	nearer := filepath.Join(root, "svc", ".rwx", "sandbox.yml")
	touch(t, nearer, "x")
	if got, _ := findConfig(sub, root, ""); got != nearer {
		t.Fatalf("nearest: %q, want %q", got, nearer)
	}
	if got, _ := findConfig(sub, root, "../../custom.yml"); got != filepath.Join(root, "custom.yml") {
		t.Fatalf("explicit relative: %q", got)
	}
	for _, bad := range []string{"/etc/passwd", "../../../x.yml"} {
		if _, err := findConfig(sub, root, bad); !errors.Is(err, errdefs.ErrInvalid) {
			t.Fatalf("config %q outside the repository: %v", bad, err)
		}
	}
}

func TestRemoteRunMatching(t *testing.T) {
	m := &Manager{}
	p := place{Identity: store.Identity{RepoRoot: "/src/app", Branch: "main", ConfigFile: "/src/app/.rwx/sandbox.yml"}}
	run := func(cs rwxapi.CLIState) rwxapi.RunSummary {
		return rwxapi.RunSummary{ID: "r", CLIState: cs.Encode()}
	}
	cases := []struct {
		name string
		run  rwxapi.RunSummary
		want bool
	}{
		{"the RWX CLI's state", run(rwxapi.CLIState{Branch: "main", ConfigFile: "/src/app/.rwx/sandbox.yml"}), true},
		{"an older RWX CLI's relative state", run(rwxapi.CLIState{Branch: "main", ConfigFile: ".rwx/sandbox.yml"}), true},
		{"the RWX CLI's state of another checkout", run(rwxapi.CLIState{Branch: "main", ConfigFile: "/src/other/.rwx/sandbox.yml"}), false},
		{"sandboxd's state today", run(rwxapi.CLIState{Branch: "main", ConfigFile: "/src/app/.rwx/sandbox.yml", RepoRoot: "/src/app", ConfigRel: ".rwx/sandbox.yml"}), true},
		{"sandboxd's state", run(rwxapi.CLIState{Branch: "main", ConfigFile: ".rwx/sandbox.yml", RepoRoot: "/src/app"}), true},
		{"another repository", run(rwxapi.CLIState{Branch: "main", ConfigFile: ".rwx/sandbox.yml", RepoRoot: "/src/other"}), false},
		{"another branch", run(rwxapi.CLIState{Branch: "dev", ConfigFile: ".rwx/sandbox.yml"}), false},
		{"another config", run(rwxapi.CLIState{Branch: "main", ConfigFile: ".rwx/other.yml"}), false},
		{"no state", rwxapi.RunSummary{ID: "r"}, false},
		{"garbage state", rwxapi.RunSummary{ID: "r", CLIState: "%%%"}, false},
	}
	for _, c := range cases {
		if got := m.matches(c.run, p); got != c.want {
			t.Errorf("%s: matches = %v, want %v", c.name, got, c.want)
		}
	}
	// Background adoption only trusts states that name a checkout.
	if _, ok := m.identityOf(run(rwxapi.CLIState{Branch: "main", ConfigFile: ".rwx/sandbox.yml"})); ok {
		t.Error("a relative state names no checkout and must not be adopted in the background")
	}
	if _, ok := m.identityOf(run(rwxapi.CLIState{Branch: "main", ConfigFile: "/nonexistent/app/.rwx/sandbox.yml"})); ok {
		t.Error("a state naming no checkout of this machine must not be adopted in the background")
	}
	id, ok := m.identityOf(run(rwxapi.CLIState{Branch: "main", ConfigFile: ".rwx/sandbox.yml", RepoRoot: "/src/app"}))
	if !ok || id != p.Identity {
		t.Errorf("identityOf = %+v, %v; want %+v", id, ok, p.Identity)
	}
}

// TestCLIStateOfACheckout: today's RWX CLI names a checkout by an absolute
// config path, spelled the way the shell's working directory was (through a
// symlink, say); sandboxd finds the same identity from it.
func TestCLIStateOfACheckout(t *testing.T) {
	m := &Manager{}
	root := canonical(t.TempDir())
	mkdirs(t, filepath.Join(root, "app", ".git"))
	cfg := filepath.Join(root, "app", ".rwx", "sandbox.yml")
	touch(t, cfg, "tasks: []\n")
	link := filepath.Join(root, "link")
	if err := os.Symlink(filepath.Join(root, "app"), link); err != nil {
		t.Fatal(err)
	}
	want := store.Identity{RepoRoot: filepath.Join(root, "app"), Branch: "main", ConfigFile: cfg}
	for _, spelled := range []string{cfg, filepath.Join(link, ".rwx", "sandbox.yml")} {
		r := rwxapi.RunSummary{ID: "r", CLIState: rwxapi.CLIState{Branch: "main", ConfigFile: spelled}.Encode()}
		if id, ok := m.identityOf(r); !ok || id != want {
			t.Errorf("identityOf(%s) = %+v, %v; want %+v", spelled, id, ok, want)
		}
		if !m.matches(r, place{Identity: want}) {
			t.Errorf("a run of %s does not match its checkout", spelled)
		}
	}
}

func TestReadRwxDirectorySkipsBookkeepingAndBoundsSize(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, ".rwx")
	touch(t, filepath.Join(dir, "sandbox.yml"), "tasks: []\n")
	touch(t, filepath.Join(dir, "lib", "steps.yml"), "x\n")
	touch(t, filepath.Join(dir, "sandboxes", "sandboxes.json"), "{}")
	entries, err := readRwxDirectory(context.Background(), root, dir)
	if err != nil {
		t.Fatal(err)
	}
	var paths []string
	for _, e := range entries {
		paths = append(paths, e.Type+":"+e.Path)
	}
	if got := strings.Join(paths, ","); got != "dir:lib,file:lib/steps.yml,file:sandbox.yml" {
		t.Fatalf("entries = %s", got)
	}
	touch(t, filepath.Join(dir, "big.bin"), strings.Repeat("x", repofile.MaxDirBytes+1))
	if _, err := readRwxDirectory(context.Background(), root, dir); !errors.Is(err, errdefs.ErrTooLarge) {
		t.Fatalf("an oversized directory: %v", err)
	}
}

func TestExitCodeOfSignalDeaths(t *testing.T) {
	for _, c := range []struct {
		st   sshpool.ExitStatus
		want int
	}{
		{sshpool.ExitStatus{Code: 0}, 0},
		{sshpool.ExitStatus{Code: 7}, 7},
		{sshpool.ExitStatus{Signal: "INT"}, 130},
		{sshpool.ExitStatus{Signal: "KILL"}, 137},
		{sshpool.ExitStatus{Signal: "TERM"}, 143},
		{sshpool.ExitStatus{Signal: "WEIRD"}, 255},
	} {
		if got := c.st.ShellCode(); got != c.want {
			t.Errorf("%+v.ShellCode() = %d, want %d", c.st, got, c.want)
		}
	}
}

func TestTitleNamesProjectBranchAndConfig(t *testing.T) {
	p := place{Identity: store.Identity{RepoRoot: "/src/app", Branch: "detached@abc1234", ConfigFile: "/src/app/ci/sb.yml"}}
	if got := title(p); got != "Sandbox: app (detached abc1234) [ci/sb.yml]" {
		t.Fatalf("title = %q", got)
	}
}

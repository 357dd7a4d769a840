package gitsync

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// strayEdit is what scp, an ssh edit or a background process does in the
// sandbox after an exec's pull: a new file and an edit, no exec involved.
const strayEdit = "echo sent > sent.txt && echo 'over ssh' >> a.txt"

func (f *fixture) assertStrayBack() {
	f.t.Helper()
	for name, want := range map[string]string{"sent.txt": "sent\n", "a.txt": "a\nover ssh\n"} {
		if got := string(fileBytes(f.t, filepath.Join(f.local, name))); got != want {
			f.t.Fatalf("local %s = %q, want %q", name, got, want)
		}
	}
}

// An edit made in the sandbox after an exec was pulled comes back at the
// next exec instead of being reset away.
func TestStrayEditsComeBackAtTheNextExec(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	if _, _, err := f.exec("echo made > made.txt"); err != nil {
		t.Fatal(err)
	}
	f.inSandbox(strayEdit)
	if _, _, err := f.exec("true"); err != nil {
		t.Fatal(err)
	}
	f.assertStrayBack()
	if got := string(fileBytes(t, filepath.Join(f.local, "made.txt"))); got != "made\n" {
		t.Fatalf("made.txt = %q", got)
	}
	assertTree(t, f.sandbox, tree(t, f.local))
}

// A push alone (nook push) brings them back first and says so.
func TestStrayEditsComeBackBeforeAPush(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	f.push()
	if _, err := f.pull(); err != nil {
		t.Fatal(err)
	}
	f.inSandbox(strayEdit)
	ctx := context.Background()
	p, err := f.s.Prepare(ctx, f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	p.PushOnly = true
	res, err := f.s.Push(ctx, f.r, p)
	if err != nil {
		t.Fatal(err)
	}
	if !res.Again || res.Recovered == nil || !strings.Contains(strings.Join(res.Warnings, "\n"), "outside an exec") {
		t.Fatalf("push result %+v", res)
	}
	if got := strings.Join(res.Recovered.Files, ","); got != "a.txt,sent.txt" {
		t.Fatalf("recovered files %q", got)
	}
	f.assertStrayBack()
	f.pushAndCompare()
}

// Pull on demand brings them back once; a second pull finds nothing, and
// the edits an exec's pull already brought are not brought again.
func TestPullOnDemandBringsStrayEditsOnce(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	if _, _, err := f.exec("echo made > made.txt"); err != nil {
		t.Fatal(err)
	}
	f.inSandbox(strayEdit)
	res, err := f.pull()
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(res.Files, ","); got != "a.txt,sent.txt" {
		t.Fatalf("pulled files %q", got)
	}
	f.assertStrayBack()
	res, err = f.pull()
	if err != nil || len(res.Files) != 0 {
		t.Fatalf("second pull: %v %v", res.Files, err)
	}
	f.pushAndCompare()
}

// A stray edit that conflicts with the local tree is saved under
// .git/sandboxd/pulls and named, never dropped.
func TestConflictingStrayEditsAreSavedAndNamed(t *testing.T) {
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	if _, _, err := f.exec("true"); err != nil {
		t.Fatal(err)
	}
	f.inSandbox("echo sandbox > a.txt")
	writeFile(t, filepath.Join(f.local, "a.txt"), "local\n")
	ctx := context.Background()
	p, err := f.s.Prepare(ctx, f.local, f.base)
	if err != nil {
		t.Fatal(err)
	}
	res, err := f.s.Push(ctx, f.r, p)
	if err != nil {
		t.Fatal(err)
	}
	if res.Recovered == nil || res.Recovered.SavedPatch == "" {
		t.Fatalf("push result %+v", res)
	}
	w := strings.Join(res.Warnings, "\n")
	if !strings.Contains(w, res.Recovered.SavedPatch) || !strings.Contains(res.Recovered.SavedPatch, filepath.Join(".git", "sandboxd", "pulls")) {
		t.Fatalf("warnings %q do not name %s", w, res.Recovered.SavedPatch)
	}
	if saved, err := os.ReadFile(res.Recovered.SavedPatch); err != nil || !strings.Contains(string(saved), "+sandbox") {
		t.Fatalf("saved patch %q %v", saved, err)
	}
}

// With the helper, the edits are found by its native pull (no git in the
// sandbox), come back, and the exec after them is native again.
func TestStrayEditsComeBackWithTheHelper(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	for i := 0; i < 2; i++ { // the first adopts, the second is native
		if _, fr, err := f.fused("echo made > made.txt"); err != nil || !fr.Native {
			t.Fatalf("exec %d: native %v, err %v", i, fr.Native, err)
		}
	}
	f.inSandbox(strayEdit)
	_, fr, err := f.fused("true")
	if err != nil || !fr.Native {
		t.Fatalf("exec after the stray edits: native %v, err %v", fr.Native, err)
	}
	f.assertStrayBack()
	assertTree(t, f.sandbox, tree(t, f.local))
	if native := string(fileBytes(t, filepath.Join(f.sandbox, ".git", "sandboxd", "native.err"))); native != "" {
		t.Fatalf("the exec after them was not native: %s", native)
	}
}

// With the helper but without its native look (it has no tree of a last
// native pull to look from), the exchange's stray script finds the edits
// with git and they come back all the same.
func TestStrayEditsComeBackWithTheHelperByItsScript(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	for i := 0; i < 2; i++ {
		if _, fr, err := f.fused("echo made > made.txt"); err != nil || !fr.Native {
			t.Fatalf("exec %d: native %v, err %v", i, fr.Native, err)
		}
	}
	f.inSandbox(strayEdit + "\nrm .git/sandboxd/pulled.tree")
	if _, _, err := f.fused("true"); err != nil {
		t.Fatalf("exec after the stray edits: %v", err)
	}
	f.assertStrayBack()
	assertTree(t, f.sandbox, tree(t, f.local))
}

// A synced exec with the helper starts one helper process in the sandbox,
// the exchange: it looks for stray edits itself (the server's native pull
// against the tree the last pull left) instead of a second process, and
// edits it finds come back.
func TestFusedExecStartsOneHelperProcess(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	for i := 0; i < 2; i++ { // the first adopts, the second is native
		if _, fr, err := f.fused("echo made > made.txt"); err != nil || !fr.Native {
			t.Fatalf("exec %d: native %v, err %v", i, fr.Native, err)
		}
	}
	// Every start of the helper is written down by a wrapper in its place.
	bin := filepath.Join(f.sandbox, ".git", "sandboxd", "bin", f.r.helperName)
	if err := os.Rename(bin, bin+".real"); err != nil {
		t.Fatal(err)
	}
	log := filepath.Join(t.TempDir(), "starts")
	writeFile(t, bin, "#!/bin/sh\necho \"$1\" >>"+log+"\nexec \""+bin+".real\" \"$@\"\n")
	if err := os.Chmod(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	starts := func() string {
		b, _ := os.ReadFile(log)
		_ = os.Remove(log)
		return strings.TrimSpace(string(b))
	}
	writeFile(t, filepath.Join(f.local, "b.txt"), "local\n")
	if _, fr, err := f.fused("true"); err != nil || !fr.Native {
		t.Fatalf("exec: native %v, err %v", fr.Native, err)
	}
	if got := starts(); got != "exchange" {
		t.Fatalf("helper processes of one exec: %q, want only the exchange", got)
	}
	f.inSandbox(strayEdit)
	if _, _, err := f.fused("true"); err != nil {
		t.Fatal(err)
	}
	// They come back first (the exchange answers Again), then the command
	// runs in a second exchange: still no other helper process.
	if got := starts(); strings.ReplaceAll(got, "exchange", "") != "\n" {
		t.Fatalf("helper processes of the exec after stray edits: %q, want two exchanges", got)
	}
	f.assertStrayBack()
	assertTree(t, f.sandbox, tree(t, f.local))
}

// When the exchange cannot ask the helper's server (it went away), the
// look for stray edits takes the shell's way (the request's stray script)
// and they still come back.
func TestStrayEditsComeBackWhenTheHelperServerIsGone(t *testing.T) {
	useHelper = true
	t.Cleanup(func() { useHelper = false })
	f := newFixture(t, map[string]string{"a.txt": "a\n"})
	for i := 0; i < 2; i++ {
		if _, fr, err := f.fused("echo made > made.txt"); err != nil || !fr.Native {
			t.Fatalf("exec %d: native %v, err %v", i, fr.Native, err)
		}
	}
	f.inSandbox(strayEdit)
	sock := filepath.Join(f.sandbox, ".git", "sandboxd", "helper", f.r.helperInstance+".sock")
	if err := os.Rename(sock, sock+".away"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.fused("true"); err != nil {
		t.Fatal(err)
	}
	f.assertStrayBack()
	assertTree(t, f.sandbox, tree(t, f.local))
}

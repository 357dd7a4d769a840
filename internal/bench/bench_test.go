package bench_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandboxd/sandboxd/internal/bench"
	"github.com/sandboxd/sandboxd/internal/testutil"
)

// TestQuickSmoke runs the benchmark program in quick mode, as `make bench`
// runs it in full: it must complete and print the table and the JSON. No
// timing is asserted (speed is measured, never tested).
func TestQuickSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binaries and runs the quick benchmark (about a minute)")
	}
	// Plain builds (not -race): this checks that the program works, and the
	// race-built binaries are exercised by the end-to-end tests.
	bin, err := testutil.Binaries(false, "github.com/sandboxd/sandboxd/cmd/sandboxd", "github.com/sandboxd/sandboxd/cmd/nook",
		"github.com/sandboxd/sandboxd/cmd/sandboxd-localcloud", "github.com/sandboxd/sandboxd/cmd/sandboxd-helper", "github.com/sandboxd/sandboxd/cmd/sandboxd-bench")
	defer testutil.Cleanup()
	if err != nil {
		t.Fatalf("build: %v", err)
	}
	out := filepath.Join(t.TempDir(), "bench.json")
	cmd := exec.Command(filepath.Join(bin, "sandboxd-bench"), "-quick", "-json", out)
	cmd.Env = append(os.Environ(), "RWX_CLI=")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("sandboxd-bench -quick: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}
	for _, want := range []string{"median ms", "exec --no-sync -- true, nook", "synced exec -- true", "32 callers on 1 sandbox", "nook list", "READY=1", "ratios", "of silence", "rwx: synced exec -- true, 1 changed file", "rwx, sync_helper off: exec --no-sync"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("the table lacks %q:\n%s", want, stdout.String())
		}
	}
	var res bench.Result
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &res); err != nil || len(res.Rows) == 0 {
		t.Fatalf("JSON results: %v, %d rows", err, len(res.Rows))
	}
	// The sandbox helpers served before the scenarios (the synced rows
	// measure the native sync, and no helper's start falls on them).
	for _, n := range res.Notes {
		if strings.Contains(n, "sandbox helper") {
			t.Errorf("note: %s", n)
		}
	}
	for _, r := range res.Rows {
		if v, ok := r.Extra["overlaps"]; ok && v != 0 {
			t.Errorf("%s: %v commands overlapped on one sandbox", r.Scenario, v)
		}
	}
}

// -only takes the scenario groups by name and refuses another, naming
// them; -repeat wants a count, -files file counts.
func TestFlagsNameTheGroups(t *testing.T) {
	for _, args := range [][]string{{"-only", "callers,nope"}, {"-repeat", "0"}, {"-files", "200,0"}, {"-files", "200,many"}} {
		var stderr bytes.Buffer
		if code := bench.Main(context.Background(), args, io.Discard, &stderr); code != 2 {
			t.Errorf("%v: exit %d, want 2", args, code)
		}
		if args[0] == "-only" && !strings.Contains(stderr.String(), `no such scenario group; the groups are no-sync, synced, burst`) {
			t.Errorf("%v: %s", args, stderr.String())
		}
		if args[0] == "-files" && !strings.Contains(stderr.String(), "want file counts such as 200,50000") {
			t.Errorf("%v: %s", args, stderr.String())
		}
	}
}

// A relative -bin is taken from the current directory, not from the
// repositories' directories the binaries run in.
func TestBinIsMadeAbsolute(t *testing.T) {
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	if code := bench.Main(context.Background(), []string{"-bin", "no-such-dir"}, io.Discard, &stderr); code != 2 || !strings.Contains(stderr.String(), filepath.Join(wd, "no-such-dir")) {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
}

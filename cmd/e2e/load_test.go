package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/internal/testutil"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
)

// long reports whether the long forms of the reliability suites run
// (make test-long); make test runs their short forms.
func long() bool { return testutil.Long() }

// loadLog is where each load command appends its start and end lines, in
// the sandbox (under .git, so no sync ever touches it).
const loadLog = ".git/nook-load.log"

type fullHealth struct {
	Goroutines int    `json:"goroutines"`
	HeapBytes  uint64 `json:"heapBytes"`
	LiveStream int    `json:"liveStreams"`
}

// fullHealth asks on a connection of its own that it closes: an idle
// keep-alive connection holds a daemon goroutine, which would blur the
// count it reads.
func (e *env) fullHealth() fullHealth {
	e.t.Helper()
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", e.socket())
	}}}
	resp, err := hc.Get("http://sandboxd/v1/health")
	if err != nil {
		e.t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		e.t.Fatal(err)
	}
	var h fullHealth
	if err := json.Unmarshal(b, &h); err != nil {
		e.t.Fatal(err)
	}
	return h
}

// TestLoadManyClientsManySandboxes: many concurrent clients (each its own
// socket client, as separate processes would be) run commands on several
// sandboxes at once. Every request gets its answer within a bound, no
// command is lost or run twice, commands on one sandbox never overlap (each
// appends a start and an end line: the lines of a sandbox must alternate
// start/end of the same command), and the daemon's goroutines and live heap
// come back to their level before the load. Short form in make test; 10
// sandboxes, 100 clients in make test-long.
//
// Not parallel: it runs alone (before the parallel tests start), so that
// the load is its own and its time bound measures the daemon, not the
// other tests.
func TestLoadManyClientsManySandboxes(t *testing.T) {
	sandboxes, clients, perClient := 2, 12, 2
	if long() {
		sandboxes, clients, perClient = 10, 100, 10
	}
	e := newEnv(t)
	e.startDaemon()
	repos := make([]string, sandboxes)
	var wg sync.WaitGroup
	for i := range repos {
		repos[i] = e.newRepo(fmt.Sprintf("load%d", i), defaultConfig)
	}
	for _, repo := range repos {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.startSandbox(repo)
		}()
	}
	wg.Wait()
	// Warm every connection, then take the baseline.
	for _, repo := range repos {
		e.mustNook(repo, "exec", "--no-sync", "--", "rm", "-f", loadLog)
	}
	base := e.fullHealth()

	bound := 2 * time.Minute
	if long() {
		bound = 10 * time.Minute
	}
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	var failed, sent atomic.Int64
	errs := make(chan string, clients*perClient)
	start := time.Now()
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cl := client.New(e.socket())
			defer cl.Close()
			repo := repos[c%sandboxes]
			for k := range perClient {
				id := fmt.Sprintf("c%d-%d", c, k)
				cmd := fmt.Sprintf("echo start %s $(date +%%s%%N) >> %s; sleep 0.01; echo end %s $(date +%%s%%N) >> %s; echo %s", id, loadLog, id, loadLog, id)
				var out strings.Builder
				sent.Add(1)
				res, err := cl.Exec(ctx, ipc.ExecRequest{Target: ipc.Target{Cwd: repo}, Argv: []string{"sh", "-c", cmd}, NoSync: true}, client.ExecOptions{Stdout: &out})
				switch {
				case err != nil:
					errs <- fmt.Sprintf("%s: %v", id, err)
				case res.ExitCode != 0 || strings.TrimSpace(out.String()) != id:
					errs <- fmt.Sprintf("%s: exit %d, output %q", id, res.ExitCode, out.String())
				default:
					continue
				}
				failed.Add(1)
			}
		}()
	}
	wg.Wait()
	close(errs)
	took := time.Since(start)
	for msg := range errs {
		t.Errorf("lost request: %s", msg)
	}
	if t.Failed() {
		t.FailNow()
	}

	// Per sandbox: every command's start and end, alternating.
	total := 0
	for i, repo := range repos {
		r := e.mustNook(repo, "exec", "--no-sync", "--", "cat", loadLog)
		ls := strings.Split(strings.TrimSpace(r.stdout), "\n")
		seen := map[string]bool{}
		for j := 0; j < len(ls); j += 2 {
			s, en := strings.Fields(ls[j]), []string{}
			if j+1 < len(ls) {
				en = strings.Fields(ls[j+1])
			}
			if len(s) != 3 || len(en) != 3 || s[0] != "start" || en[0] != "end" || s[1] != en[1] {
				t.Fatalf("sandbox %d: commands overlapped or were cut at line %d:\n%s", i, j+1, r.stdout)
			}
			if s[2] > en[2] && len(s[2]) == len(en[2]) {
				t.Fatalf("sandbox %d: %s ended before it started", i, s[1])
			}
			if seen[s[1]] {
				t.Fatalf("sandbox %d: command %s ran twice", i, s[1])
			}
			seen[s[1]] = true
		}
		want := 0
		for c := range clients {
			if c%sandboxes == i {
				want += perClient
			}
		}
		if len(seen) != want {
			t.Fatalf("sandbox %d ran %d commands, want %d", i, len(seen), want)
		}
		total += len(seen)
	}
	t.Logf("load: %d sandboxes, %d clients, %d requests in %s, %d failed; goroutines %d before", sandboxes, clients, sent.Load(), took.Round(time.Millisecond), failed.Load(), base.Goroutines)

	// Back to the level before the load: the goroutines exactly (a little
	// slack for background work such as a reconcile pass), the live heap
	// within a margin (it is measured at the last collection).
	var h fullHealth
	deadline := time.Now().Add(30 * time.Second)
	for h = e.fullHealth(); h.Goroutines > base.Goroutines+3; h = e.fullHealth() {
		if time.Now().After(deadline) {
			t.Fatalf("the daemon's goroutines did not come back to their level: %d after the load, %d before", h.Goroutines, base.Goroutines)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if limit := 2*base.HeapBytes + 32<<20; h.HeapBytes > limit {
		t.Fatalf("live heap %d bytes after the load, %d before (limit %d)", h.HeapBytes, base.HeapBytes, limit)
	}
	t.Logf("after: goroutines %d (before %d), live heap %d KiB (before %d KiB), %d commands checked", h.Goroutines, base.Goroutines, h.HeapBytes>>10, base.HeapBytes>>10, total)
}

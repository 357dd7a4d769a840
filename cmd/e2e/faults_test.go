package e2e

import (
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

// A failure report must say what happened, whether the command may have
// run, and what to do.
var (
	reportMayHaveRun = regexp.MustCompile(`(?i)may or may not have|may have run|did not run|was not run|never ran|not started|before the command ran|no command ran`)
	reportWhatToDo   = regexp.MustCompile(`(?i)retry|run the command again|run it again|try again|check |see |nook (status|reset|start|list)|later`)
)

// checkFailure checks one exec that did not succeed: exit 125 and a report
// that says what happened, whether the command may have run, and what to
// do.
func checkFailure(t testing.TB, what string, r result) {
	t.Helper()
	msg := strings.TrimSpace(r.stderr)
	switch {
	case r.code != 125:
		t.Errorf("%s: exit %d, want 0 or 125\n%s", what, r.code, r)
	case msg == "":
		t.Errorf("%s: exit 125 without a message", what)
	case !reportMayHaveRun.MatchString(msg):
		t.Errorf("%s: the report does not say whether the command may have run: %s", what, msg)
	case !reportWhatToDo.MatchString(msg):
		t.Errorf("%s: the report does not say what to do: %s", what, msg)
	}
}

// faultExec runs one exec whose command appends its id to counter and
// records the outcome.
type faultOutcome struct {
	id string
	r  result
}

func (e *env) faultExec(repo, counter, id string, extra ...string) faultOutcome {
	args := append([]string{"exec", "--no-sync"}, extra...)
	args = append(args, "--", "sh", "-c", "echo "+id+" >> "+counter)
	return faultOutcome{id: id, r: e.nook(repo, args...)}
}

// checkOutcomes: every exec succeeded (its id once in counter) or failed
// with a proper report (its id at most once); no id twice.
func checkOutcomes(t testing.TB, scenario, counter string, outs []faultOutcome) (ok, failed int) {
	t.Helper()
	ran := map[string]int{}
	for _, l := range strings.Fields(readFileOr(counter)) {
		ran[l]++
	}
	for _, o := range outs {
		if ran[o.id] > 1 {
			t.Errorf("%s: command %s ran %d times", scenario, o.id, ran[o.id])
		}
		if o.r.code == 0 {
			ok++
			if ran[o.id] != 1 {
				t.Errorf("%s: exec %s succeeded but its command ran %d times", scenario, o.id, ran[o.id])
			}
			continue
		}
		failed++
		checkFailure(t, scenario+" "+o.id, o.r)
	}
	return ok, failed
}

func readFileOr(path string) string {
	b, _ := os.ReadFile(path)
	return string(b)
}

// TestFaultMatrix: with the local remote's fault injection, every exec
// completes or fails with exit 125 and a report saying what happened,
// whether the command may have run and what to do, and no command runs
// twice: 30% of API calls answered 503 (while sandboxes are created and
// used), the API slower than the daemon's patience, SSH connections dropped
// between commands, SSH dropped while commands run, and SSH refused.
func TestFaultMatrix(t *testing.T) {
	t.Parallel()
	n := 2
	if long() {
		n = 25
	}
	e := newEnv(t)
	lc := e.startLocalcloud()
	// The API's slowness goes past the daemon's bound of each call.
	e.writeConfig(map[string]any{"reconcile_interval": "1s", "api_timeout": "1s", "reattach_timeout": "5s"})
	e.startDaemon()
	warm := e.newRepo("warm", defaultConfig)
	run := e.startSandbox(warm)
	injected := map[string]int{}
	faults := func(f map[string]any) {
		lc.call(t, "POST", "/admin/faults", f)
	}

	t.Run("5xx", func(t *testing.T) {
		counter := counterFile(t, "5xx")
		faults(map[string]any{"error_rate_5xx": 0.3})
		defer faults(map[string]any{"error_rate_5xx": 0.0})
		var outs []faultOutcome
		var mu sync.Mutex
		var wg sync.WaitGroup
		for i := range n {
			// Fresh checkouts: create, wait for ready and connect all go
			// through the failing API; the warm one needs no API call.
			repo := e.newRepo(fmt.Sprintf("fivexx%d", i), defaultConfig)
			wg.Add(2)
			go func() {
				defer wg.Done()
				o := e.faultExec(repo, counter, fmt.Sprintf("new%d", i))
				mu.Lock()
				outs = append(outs, o)
				mu.Unlock()
			}()
			go func() {
				defer wg.Done()
				o := e.faultExec(warm, counter, fmt.Sprintf("warm%d", i))
				mu.Lock()
				outs = append(outs, o)
				mu.Unlock()
			}()
		}
		wg.Wait()
		ok, failed := checkOutcomes(t, "5xx", counter, outs)
		injected["5xx"] += len(outs)
		t.Logf("30%% 5xx: %d execs, %d completed, %d failed with a report", len(outs), ok, failed)
	})

	t.Run("ssh-dropped-between", func(t *testing.T) {
		counter := counterFile(t, "between")
		var outs []faultOutcome
		for i := range n {
			lc.call(t, "POST", "/admin/runs/"+run+"/drop-connections", nil)
			injected["ssh-dropped-between"]++
			outs = append(outs, e.faultExec(warm, counter, fmt.Sprintf("b%d", i)))
		}
		ok, failed := checkOutcomes(t, "ssh dropped between commands", counter, outs)
		t.Logf("ssh dropped between commands: %d completed, %d failed with a report", ok, failed)
	})

	t.Run("ssh-dropped-during", func(t *testing.T) {
		// Durable exec is on by default: where the sandbox helper serves,
		// the command survives its dropped connection, its status comes
		// back and it ran once.
		e.mustNook(warm, "exec", "--", "true")
		e.waitHelper(t, run)
		e.mustNook(warm, "exec", "--", "true")
		counter := counterFile(t, "during")
		var outs []faultOutcome
		for i := range n {
			id := fmt.Sprintf("d%d", i)
			b := e.nookBackground(warm, "exec", "--no-sync", "--", "sh", "-c", "echo "+id+" >> "+counter+"; sleep 3")
			waitUntil(t, 30*time.Second, "command "+id+" to start", func() bool { return strings.Contains(readFileOr(counter), id) })
			lc.call(t, "POST", "/admin/runs/"+run+"/drop-connections", nil)
			injected["ssh-dropped-during"]++
			r := b.wait(t, 60*time.Second)
			outs = append(outs, faultOutcome{id: id, r: r})
			if r.code != 0 || !strings.Contains(r.stderr, "is reattached") {
				t.Errorf("%s: a held command whose connection was dropped did not survive it: %s", id, r)
			}
		}
		checkOutcomes(t, "ssh dropped during a command", counter, outs)
	})

	t.Run("ssh-refused", func(t *testing.T) {
		counter := counterFile(t, "refused")
		faults(map[string]any{"drop_ssh": true})
		injected["ssh-refused"]++
		var outs []faultOutcome
		for i := range max(1, n/2) {
			outs = append(outs, e.faultExec(warm, counter, fmt.Sprintf("r%d", i)))
		}
		faults(map[string]any{"drop_ssh": false})
		ok, _ := checkOutcomes(t, "ssh refused", counter, outs)
		if ok != 0 {
			t.Errorf("%d execs succeeded while the agent refused every connection", ok)
		}
		if strings.TrimSpace(readFileOr(counter)) != "" {
			t.Errorf("commands ran while the agent refused every connection: %q", readFileOr(counter))
		}
		// It comes back.
		waitUntil(t, 30*time.Second, "an exec to work again after SSH came back", func() bool {
			return e.nook(warm, "exec", "--no-sync", "--", "true").code == 0
		})
	})

	t.Run("api-slower-than-timeouts", func(t *testing.T) {
		counter := counterFile(t, "slow")
		faults(map[string]any{"latency_ms": 600_000})
		defer faults(map[string]any{"latency_ms": 0})
		var outs []faultOutcome
		// The warm sandbox needs no API call; a new checkout does.
		for i := range max(1, n/2) {
			outs = append(outs, e.faultExec(warm, counter, fmt.Sprintf("sw%d", i)))
		}
		// A new checkout needs the API: its exec fails within the bounds,
		// says so, and nothing ran.
		repo := e.newRepo("slowapi", defaultConfig)
		b := e.nookBackground(repo, "exec", "--no-sync", "--", "sh", "-c", "echo sn >> "+counter)
		r := b.wait(t, 90*time.Second)
		outs = append(outs, faultOutcome{id: "sn", r: r})
		injected["latency"] += len(outs)
		if r.code == 0 {
			t.Errorf("an exec needing an API that never answers in time succeeded: %s", r)
		}
		ok, _ := checkOutcomes(t, "API slower than every timeout", counter, outs)
		if ok < len(outs)-1 {
			t.Errorf("execs on a warm sandbox need no API call and must complete: %d of %d did", ok, len(outs)-1)
		}
	})
	t.Logf("faults injected: %v", injected)
}

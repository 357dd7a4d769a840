package sessions

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/store"
)

// TestProcessRecordsFromTheSandboxAreCheckedAndBounded: a process record is
// the sandbox's word (on RWX Cloud the agent answering it runs inside the
// sandbox). Through a real agent and the real pool, each answer below is
// what a hostile agent prints: a flood, a record of another key, an unknown
// status, insane numbers, a relative log path, two records, terminal
// escapes on stderr, silence. Each is refused with an error saying why,
// within the directive's bound; a sane record is taken.
func TestProcessRecordsFromTheSandboxAreCheckedAndBounded(t *testing.T) {
	_, target := startAgent(t)
	pool := sshpool.New(sshpool.Options{})
	t.Cleanup(func() { pool.Close() })
	conn, err := pool.NewLink(nil).Get(context.Background(), target)
	if err != nil {
		t.Fatal(err)
	}
	saved := processDirectiveWait
	processDirectiveWait = 3 * time.Second
	t.Cleanup(func() { processDirectiveWait = saved })
	m := &Manager{}
	// The directive's payload follows the "name": "#" makes it a comment,
	// so the agent's shell prints exactly the answer given.
	answer := func(script string) (processRecord, time.Duration, error) {
		start := time.Now()
		rec, err := m.processDirective(context.Background(), conn, script+" #", map[string]any{"key": "web"})
		return rec, time.Since(start), err
	}
	for _, c := range []struct{ name, script, want string }{
		{"a flood", "yes", "over 524288 bytes"},
		{"a record of 600 KiB", `printf '{"key":"web","status":"running","command":"'; head -c 600000 /dev/zero | tr '\0' x; printf '"}'`, "over 524288 bytes"},
		{"another key", `printf '{"key":"db","status":"running"}'`, `record of "db", not of "web"`},
		{"an unknown status", `printf '{"key":"web","status":"pwned"}'`, `status "pwned" is not one of`},
		{"a negative pid", `printf '{"key":"web","status":"running","pid":-1}'`, "not process ids"},
		{"a huge pgid", `printf '{"key":"web","status":"running","pgid":99999999}'`, "not process ids"},
		{"a port out of range", `printf '{"key":"web","status":"running","targetPort":70000}'`, "not a port"},
		{"an exit code out of range", `printf '{"key":"web","status":"exited","exitCode":4096}'`, "not an exit status"},
		{"a forged signal", `printf '{"key":"web","status":"exited","signal":"\\u001b[2J"}'`, "not a signal name"},
		{"a relative log path", `printf '{"key":"web","status":"running","stdoutPath":"../../.bashrc"}'`, "not an absolute path"},
		{"a log path with a newline", `printf '{"key":"web","status":"running","stderrPath":"/tmp/a\\nb"}'`, "not an absolute path"},
		{"a bad time", `printf '{"key":"web","status":"running","startedAt":"yesterday"}'`, "not an RFC 3339 time"},
		{"two records", `printf '{"key":"web","status":"running"}{"key":"web","status":"stopped"}'`, "more than one process record"},
		{"not JSON", `printf 'hello'`, "not a process record"},
		{"silence", "sleep 30", "did not answer"},
	} {
		_, took, err := answer(c.script)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v; want one saying %q", c.name, err, c.want)
		}
		if took > processDirectiveWait+5*time.Second {
			t.Errorf("%s: took %s, past the directive's bound %s", c.name, took, processDirectiveWait)
		}
	}
	if _, _, err := answer(`printf '\033[2J\033]0;owned\007 agent failure' >&2; exit 1`); err == nil || strings.ContainsAny(err.Error(), "\x1b\x07") || !strings.Contains(err.Error(), "agent failure") {
		t.Errorf("the agent's stderr reached the error with its control characters: %q", err)
	}
	rec, _, err := answer(`printf '{"key":"web","status":"exited","pid":42,"pgid":42,"targetPort":8080,"exitCode":3,"startedAt":"2026-01-02T03:04:05Z","stdoutPath":"/w/.logs/web.out","stderrPath":"/w/.logs/web.err","futureField":1}\n'`)
	if err != nil || rec.PID != 42 || rec.ExitCode == nil || *rec.ExitCode != 3 || rec.StdoutPath != "/w/.logs/web.out" {
		t.Errorf("a sane record: %+v, %v", rec, err)
	}
}

// TestDoctorProbeOfAHostileSandboxIsBounded: doctor's probe runs `date +%s`
// in each sandbox; a sandbox whose date floods its output (or never ends)
// gets a failed check, at once for a flood and within the probe's bound
// for silence, and nothing of the flood is kept beyond a few bytes.
func TestDoctorProbeOfAHostileSandboxIsBounded(t *testing.T) {
	for _, c := range []struct{ name, script string }{
		{"a flood", "#!/bin/sh\nexec yes\n"},
		{"a flood on stderr", "#!/bin/sh\nyes >&2\n"},
		{"escapes", "#!/bin/sh\nprintf '\\033[2J\\033]0;owned\\007'\n"},
	} {
		t.Run(c.name, func(t *testing.T) {
			bin := t.TempDir()
			if err := os.WriteFile(filepath.Join(bin, "date"), []byte(c.script), 0o755); err != nil {
				t.Fatal(err)
			}
			_, target := startAgentEnv(t, []string{"PATH=" + bin + ":/usr/bin:/bin"})
			pool := sshpool.New(sshpool.Options{})
			t.Cleanup(func() { pool.Close() })
			api := newFakeRemoteAPI(t)
			m, _ := newTestManager(t, api, time.Second)
			m.opts.Pool = Links(pool)
			s := &store.Session{RunID: target.RunID, Address: target.Address, PublicHostKey: target.PublicHostKey, PrivateUserKey: target.PrivateUserKey}
			start := time.Now()
			checks := m.checkSandbox(context.Background(), s)
			if took := time.Since(start); took > 5*time.Second {
				t.Errorf("the probe took %s", took)
			}
			var failed bool
			for _, ck := range checks {
				failed = failed || !ck.OK
				if len(ck.Detail) > 2048 || strings.ContainsAny(ck.Detail, "\x1b\x07") {
					t.Errorf("check %s carries %d bytes of the sandbox's answer: %q", ck.Name, len(ck.Detail), ck.Detail)
				}
			}
			if !failed {
				t.Errorf("a hostile date passed the probe: %+v", checks)
			}
		})
	}
}

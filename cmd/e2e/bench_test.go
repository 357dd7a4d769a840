package e2e

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"
)

// The end-to-end benchmarks time what a user waits for, through the real
// binaries: ns/op is the mean, ms-median the median.
//
//	go test -run '^$' -bench . -benchtime 200x ./cmd/e2e/

func reportMedian(b *testing.B, samples []time.Duration) {
	b.Helper()
	if len(samples) == 0 {
		return
	}
	slices.Sort(samples)
	b.ReportMetric(float64(samples[len(samples)/2].Microseconds())/1000, "ms-median")
}

func timeSbx(b *testing.B, e *env, dir string, args ...string) {
	b.Helper()
	var samples []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		if r := e.sbx(dir, args...); r.code != 0 {
			b.Fatalf("sbx %v: %s", args, r)
		}
		samples = append(samples, time.Since(start))
	}
	b.StopTimer()
	reportMedian(b, samples)
}

// BenchmarkSbxVersion: `sbx version` answered by a running daemon.
func BenchmarkSbxVersion(b *testing.B) {
	e := newEnv(b)
	e.startDaemon()
	timeSbx(b, e, e.root, "version")
}

// BenchmarkExecNoSyncWarm: `sbx exec --no-sync -- true` on a warm sandbox.
func BenchmarkExecNoSyncWarm(b *testing.B) {
	e := newEnv(b)
	e.startDaemon()
	repo := e.newRepo("warm", defaultConfig)
	e.startSandbox(repo)
	e.mustSbx(repo, "exec", "--no-sync", "--", "true")
	timeSbx(b, e, repo, "exec", "--no-sync", "--", "true")
}

// BenchmarkExecSyncedOneFileChange: `sbx exec -- true` with one changed
// file to push, on a warm sandbox.
func BenchmarkExecSyncedOneFileChange(b *testing.B) {
	e := newEnv(b)
	e.startDaemon()
	repo := e.newRepo("synced", defaultConfig)
	e.startSandbox(repo)
	writeFile(e.t, filepath.Join(repo, "README.md"), "one local change\n")
	e.mustSbx(repo, "exec", "--", "true")
	timeSbx(b, e, repo, "exec", "--", "true")
}

// BenchmarkExecTrueFreshSSHConnection: the floor of the one-process-per-
// command design: a new SSH connection (handshake) and one exec of `true`
// per command, straight to the same sandbox agent; no API call, no sync.
func BenchmarkExecTrueFreshSSHConnection(b *testing.B) {
	e := newEnv(b)
	lc := e.startLocalcloud()
	e.startDaemon()
	repo := e.newRepo("fresh", defaultConfig)
	run := e.startSandbox(repo)
	var ci struct {
		Address        string `json:"address"`
		PublicHostKey  string `json:"public_host_key"`
		PrivateUserKey string `json:"private_user_key"`
	}
	if err := json.Unmarshal(lc.call(b, "GET", "/mint/api/sandbox_connection_info?sandbox_key="+run, nil), &ci); err != nil {
		b.Fatal(err)
	}
	signer, err := ssh.ParsePrivateKey([]byte(ci.PrivateUserKey))
	if err != nil {
		b.Fatal(err)
	}
	hostKey, _, _, _, err := ssh.ParseAuthorizedKey([]byte(ci.PublicHostKey))
	if err != nil {
		b.Fatal(err)
	}
	cfg := &ssh.ClientConfig{User: "rwx-cli", Auth: []ssh.AuthMethod{ssh.PublicKeys(signer)}, HostKeyCallback: ssh.FixedHostKey(hostKey), Timeout: 10 * time.Second}
	var samples []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		c, err := ssh.Dial("tcp", ci.Address, cfg)
		if err != nil {
			b.Fatal(err)
		}
		sess, err := c.NewSession()
		if err != nil {
			b.Fatal(err)
		}
		if err := sess.Run("true"); err != nil {
			b.Fatal(err)
		}
		c.Close()
		samples = append(samples, time.Since(start))
	}
	b.StopTimer()
	reportMedian(b, samples)
}

// BenchmarkReconnect20AfterRestart: time from a restart (after SIGKILL) of
// the daemon with 20 live sandboxes until all 20 are reconnected, as seen
// in its events; no client asks meanwhile.
func BenchmarkReconnect20AfterRestart(b *testing.B) {
	e := newEnv(b)
	d := e.startDaemon()
	runs := map[string]bool{}
	for i := range 20 {
		runs[e.startSandbox(e.newRepo(fmt.Sprintf("r%d", i), defaultConfig))] = true
	}
	var samples []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		d.kill()
		b.StartTimer()
		start := time.Now()
		d = e.startDaemon()
		evs := e.followEvents("0")
		up := map[string]bool{}
		for len(up) < len(runs) {
			ev := evs.waitFor(e.t, time.Minute, "connection.up", eventType("connection.up"))
			if id, _ := ev["runId"].(string); runs[id] {
				up[id] = true
			}
		}
		samples = append(samples, time.Since(start))
		evs.stop()
	}
	b.StopTimer()
	reportMedian(b, samples)
}

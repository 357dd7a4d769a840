package bench

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"time"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/localcloud"
)

// startWait times `sbx start --wait` from a stopped sandbox in each sized
// repository (no setup steps: the config's one task is the sandbox), and,
// when RWX_CLI names the RWX CLI, `rwx sandbox start --wait` in the same
// repository against the same localcloud, the two alternating. Stopping is
// outside the timing. The repository ends with a ready sandbox of sbx's.
// Past the smallest repository it runs at 0 ms RTT only: a large start is
// local work (cloning, checking out), and it is the longest scenario.
func (r *runner) startWait(ctx context.Context) error {
	var rwx []string
	if r.opts.RWXCLI != "" {
		vars, err := r.rwxVars()
		if err != nil {
			return err
		}
		rwx = vars
	}
	for _, files := range r.sz.repoFiles {
		if r.rtt > 0 && files != r.sz.repoFiles[0] {
			continue
		}
		repo := r.sized[files]
		n := r.sz.nStart[files]
		var sbxT, rwxT []time.Duration
		rwxFailed := rwx == nil
		for range n {
			if !rwxFailed {
				if err := r.e.sbx(ctx, repo, "stop"); err != nil {
					return err
				}
				start := time.Now()
				cmd := exec.CommandContext(ctx, r.opts.RWXCLI, "sandbox", "start", "--wait")
				cmd.Dir, cmd.Env = repo, rwx
				if out, err := cmd.CombinedOutput(); err != nil {
					r.note("RWX CLI `rwx sandbox start --wait` failed in the %d-file repository: %v: %s", files, err, out)
					rwxFailed = true
				} else {
					rwxT = append(rwxT, time.Since(start))
				}
			}
			if err := r.e.sbx(ctx, repo, "stop"); err != nil {
				return err
			}
			start := time.Now()
			if err := r.e.sbx(ctx, repo, "start", "--wait"); err != nil {
				return err
			}
			sbxT = append(sbxT, time.Since(start))
		}
		// The other scenarios use this repository's sandbox: it is new.
		resp, err := r.e.client.Start(ctx, ipc.StartRequest{Target: ipc.Target{Cwd: repo}, Wait: true})
		if err != nil {
			return fmt.Errorf("the sandbox of %s after start --wait: %w", repo, err)
		}
		r.runOf[repo] = resp.Session.RunID
		med, p95 := stats(sbxT)
		r.add(Row{Scenario: startRow(files, "sbx"), N: len(sbxT), MedianMs: med, P95Ms: p95, ExecsPerCall: -1, ChansPerCall: -1, APIPerCall: -1})
		if len(rwxT) > 0 {
			med, p95 := stats(rwxT)
			r.add(Row{Scenario: startRow(files, "RWX CLI"), N: len(rwxT), MedianMs: med, P95Ms: p95, ExecsPerCall: -1, ChansPerCall: -1, APIPerCall: -1})
		}
	}
	return nil
}

func startRow(files int, how string) string {
	return fmt.Sprintf("start --wait, no setup steps, %d files, %s", files, how)
}

// rwxVars is the RWX CLI's environment: this user's, with localcloud as its
// host, and a HOME of its own (it keeps state there).
func (r *runner) rwxVars() ([]string, error) {
	d, err := localcloud.ReadDiscovery(r.e.localcloudDir())
	if err != nil {
		return nil, err
	}
	home := filepath.Join(r.root, "rwx-home")
	if err := os.MkdirAll(home, 0o700); err != nil {
		return nil, err
	}
	return append(slices.Clone(r.e.vars), "HOME="+home, "RWX_HOST="+d.Host(), "RWX_ACCESS_TOKEN="+r.e.lcToken,
		"SSL_CERT_FILE="+d.CertFile, "RWX_HIDE_SKILL_HINT=1", "RWX_EXPERIMENTAL=true"), nil
}

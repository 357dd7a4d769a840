package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"time"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/localcloud"
	"github.com/sandboxd/sandboxd/localcloud/runs"
)

// startWait times `nook start --wait` from a stopped sandbox in each sized
// repository (no setup steps: the config's one task is the sandbox), and,
// when RWX_CLI names the RWX CLI, `rwx sandbox start --wait` in the same
// repository against the same localcloud, the two alternating. Stopping is
// outside the timing. The repository ends with a ready sandbox of nook's.
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
		var nookT, rwxT, nookOwn, rwxOwn []time.Duration
		// timed runs one start (from a stopped sandbox) and adds its time
		// and its own share to all and own; start's false says it did
		// not start and is not counted. The own share is all but
		// localcloud's provisioning (the clone and checkout, the same for
		// both tools and most of a large start), steady where the clone's
		// time is not on a loaded machine.
		timed := func(start func() (bool, error), all, own *[]time.Duration) error {
			if err := r.stopAndClean(ctx, repo); err != nil {
				return err
			}
			began := time.Now()
			ok, err := start()
			if err != nil || !ok {
				return err
			}
			took := time.Since(began)
			prov, err := r.provisioning(repo, began)
			if err != nil {
				return err
			}
			*all, *own = append(*all, took), append(*own, took-prov)
			return nil
		}
		rwxFailed := rwx == nil
		startRWX := func() error {
			if rwxFailed {
				return nil
			}
			return timed(func() (bool, error) {
				cmd := exec.CommandContext(ctx, r.opts.RWXCLI, "sandbox", "start", "--wait")
				cmd.Dir, cmd.Env = repo, rwx
				if out, err := cmd.CombinedOutput(); err != nil {
					r.note("RWX CLI `rwx sandbox start --wait` failed in the %d-file repository: %v: %s", files, err, out)
					rwxFailed = true
					return false, nil
				}
				return true, nil
			}, &rwxT, &rwxOwn)
		}
		startNook := func() error {
			return timed(func() (bool, error) {
				return true, r.e.nook(ctx, repo, "start", "--wait")
			}, &nookT, &nookOwn)
		}
		for i := range n {
			// Each tool goes first in turn: the start after another's
			// removal pays for the file system's slow inodes.
			first, second := startRWX, startNook
			if i%2 == 1 {
				first, second = startNook, startRWX
			}
			if err := first(); err != nil {
				return err
			}
			if err := second(); err != nil {
				return err
			}
		}
		// The other scenarios use this repository's sandbox: it is new.
		resp, err := r.e.client.Start(ctx, ipc.StartRequest{Target: ipc.Target{Cwd: repo}, Wait: true})
		if err != nil {
			return fmt.Errorf("the sandbox of %s after start --wait: %w", repo, err)
		}
		r.runOf[repo] = resp.Session.RunID
		add := func(how string, all, own []time.Duration) {
			med, p95 := stats(all)
			omed, _ := stats(own)
			r.add(Row{Scenario: startRow(files, how), N: len(all), MedianMs: med, P95Ms: p95, ExecsPerCall: -1, ChansPerCall: -1, APIPerCall: -1,
				Extra: map[string]float64{"own_ms": omed}, Note: "own_ms: all but localcloud's provisioning"})
		}
		add("nook", nookT, nookOwn)
		if len(rwxT) > 0 {
			add("RWX CLI", rwxT, rwxOwn)
		}
	}
	return nil
}

// stopAndClean stops repo's sandbox and waits until localcloud has removed
// the checkouts of repo's ended runs, which it does in the background: a
// start timed meanwhile would share the machine with the removal of up to
// 50,000 files. Even after it, ext4 allocates inodes slowly for a while
// after a mass deletion (recently_deleted), so the checkout's time varies
// (docs/performance.md): own_ms is the tool's share.
func (r *runner) stopAndClean(ctx context.Context, repo string) error {
	if err := r.e.nook(ctx, repo, "stop"); err != nil {
		return err
	}
	removed, err := r.waitFor(ctx, func() (bool, error) {
		all, err := r.localcloudRuns()
		if err != nil {
			return false, err
		}
		for _, run := range all {
			if run.Git.OriginURL != repo || run.CompletedAt.IsZero() {
				continue
			}
			if _, err := os.Stat(filepath.Join(r.e.localcloudDir(), "runs", run.ID, "workspace")); err == nil {
				return false, nil
			}
		}
		return true, nil
	})
	if err == nil && !removed {
		r.note("localcloud had not removed the ended sandboxes of %s after %s", repo, waitLimit)
	}
	return err
}

// provisioning is how long localcloud took to make the sandbox of repo
// that was created last, after began (from its runs file).
func (r *runner) provisioning(repo string, began time.Time) (time.Duration, error) {
	all, err := r.localcloudRuns()
	if err != nil {
		return 0, err
	}
	var last time.Time
	var prov time.Duration
	for _, run := range all {
		if run.Git.OriginURL == repo && run.CreatedAt.After(began) && run.CreatedAt.After(last) && !run.SandboxableAt.IsZero() {
			last, prov = run.CreatedAt, run.SandboxableAt.Sub(run.CreatedAt)
		}
	}
	if last.IsZero() {
		return 0, fmt.Errorf("localcloud has no sandboxable run of %s created after %s", repo, began.Format(time.RFC3339Nano))
	}
	return prov, nil
}

// localcloudRuns reads localcloud's runs file.
func (r *runner) localcloudRuns() ([]runs.Run, error) {
	b, err := os.ReadFile(filepath.Join(r.e.localcloudDir(), runs.StateFile))
	if err != nil {
		return nil, err
	}
	var state struct {
		Runs []runs.Run `json:"runs"`
	}
	if err := json.Unmarshal(b, &state); err != nil {
		return nil, fmt.Errorf("read localcloud's runs: %w", err)
	}
	return state.Runs, nil
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

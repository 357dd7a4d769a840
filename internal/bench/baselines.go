package bench

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/sandboxd/sandboxd/localcloud"
	"github.com/sandboxd/sandboxd/rwxapi"
)

const (
	directiveLock   = "__rwx_sandbox_lock_requested__"
	directiveUnlock = "__rwx_sandbox_lock_released__"
	sshUser         = "rwx-cli"
)

// dialAgent opens a new SSH connection to the sandbox agent of ci, with its
// user key and pinned host key.
func dialAgent(ci rwxapi.ConnectionInfo) (*ssh.Client, error) {
	signer, err := ssh.ParsePrivateKey([]byte(ci.PrivateUserKey))
	if err != nil {
		return nil, fmt.Errorf("parse the user key: %w", err)
	}
	hostKey, _, _, _, err := ssh.ParseAuthorizedKey([]byte(ci.PublicHostKey))
	if err != nil {
		return nil, fmt.Errorf("parse the host key: %w", err)
	}
	cfg := &ssh.ClientConfig{User: sshUser, Auth: []ssh.AuthMethod{ssh.PublicKeys(signer)}, HostKeyCallback: ssh.FixedHostKey(hostKey), Timeout: 10 * time.Second}
	return ssh.Dial("tcp", ci.Address, cfg)
}

func runOn(c *ssh.Client, command string) error {
	s, err := c.NewSession()
	if err != nil {
		return err
	}
	defer s.Close()
	return s.Run(command)
}

// outputOn runs command on a new session channel of c and returns its
// stdout.
func outputOn(c *ssh.Client, command string) (string, error) {
	s, err := c.NewSession()
	if err != nil {
		return "", err
	}
	defer s.Close()
	out, err := s.Output(command)
	return string(out), err
}

// agentDirect is the floor: one kept SSH connection, `true` per exec, no
// lock, no daemon.
func (r *runner) agentDirect(ctx context.Context, repo string) error {
	id := r.runOf[repo]
	ci, err := r.e.connInfo(ctx, id)
	if err != nil {
		return err
	}
	c, err := dialAgent(ci)
	if err != nil {
		return err
	}
	defer c.Close()
	row, err := r.measure(ctx, "agent direct: kept SSH connection, new channel + true", r.sz.n, 2, 1, []string{id}, func(int) error {
		return runOn(c, "true")
	})
	if err != nil {
		return err
	}
	r.add(row)
	return nil
}

// baselineA is the one-process-per-command client: the RWX CLI when
// RWX_CLI names it, and always the same steps written with this project's
// code (API call, fresh SSH connection, lock, command, unlock), in process.
func (r *runner) baselineA(ctx context.Context, repo string) error {
	id := r.runOf[repo]
	d, err := localcloud.ReadDiscovery(r.e.localcloudDir())
	if err != nil {
		return err
	}
	pem, err := os.ReadFile(d.CertFile)
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pem)
	row, err := r.measure(ctx, "baseline A: API call + fresh SSH + lock + true + unlock", r.sz.n, 1, 1, []string{id}, func(int) error {
		// A new process has no kept connections: fresh TLS, fresh SSH.
		hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}}, Timeout: 30 * time.Second}
		defer hc.CloseIdleConnections()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, d.APIURL+rwxapi.PathConnectionInfo+"?sandbox_key="+id, nil)
		req.Header.Set("Authorization", "Bearer "+r.e.lcToken)
		resp, err := hc.Do(req)
		if err != nil {
			return err
		}
		var ci rwxapi.ConnectionInfo
		err = json.NewDecoder(resp.Body).Decode(&ci)
		resp.Body.Close()
		if err != nil {
			return err
		}
		c, err := dialAgent(ci)
		if err != nil {
			return err
		}
		defer c.Close()
		for _, cmd := range []string{directiveLock, "true", directiveUnlock} {
			if err := runOn(c, cmd); err != nil {
				return fmt.Errorf("%s: %w", cmd, err)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	row.Note = "in process: no process start"
	r.add(row)

	if r.opts.RWXCLI == "" {
		if r.rtt == 0 {
			r.note("baseline A ran the project's own one-process-per-command steps; set RWX_CLI to a built RWX CLI to also time `rwx sandbox exec`")
		}
		return nil
	}
	vars, err := r.rwxVars()
	if err != nil {
		return err
	}
	change := func(tag string, i int) error {
		return os.WriteFile(filepath.Join(repo, "README.md"), []byte("rwx "+tag+" "+strconv.Itoa(i)+"\n"), 0o644)
	}
	row, err = r.measureChanged(ctx, "baseline A: RWX CLI `rwx sandbox exec -- true`, 1 changed file", max(3, r.sz.n/3), []string{id}, change, "rwx", func() error {
		cmd := exec.CommandContext(ctx, r.opts.RWXCLI, "sandbox", "exec", "--", "true")
		cmd.Dir, cmd.Env = repo, vars
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("%w\n%s", err, out)
		}
		return nil
	})
	if err != nil {
		r.note("RWX CLI baseline failed: %v", err)
		return nil
	}
	r.add(row)
	return nil
}

// baselineB is OpenSSH with a ControlMaster connection to the same agent,
// paired with nook exec --no-sync (alternating calls).
func (r *runner) baselineB(ctx context.Context, repo string) error {
	sshBin, err := exec.LookPath("ssh")
	if err != nil {
		if r.rtt == 0 {
			r.note("baseline B skipped: no ssh client on PATH (install openssh-client)")
		}
		return nil
	}
	id := r.runOf[repo]
	ci, err := r.e.connInfo(ctx, id)
	if err != nil {
		return err
	}
	host, port, _ := strings.Cut(ci.Address, ":")
	dir := filepath.Join(r.root, "ssh")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	key := filepath.Join(dir, "key")
	if err := os.WriteFile(key, []byte(ci.PrivateUserKey), 0o600); err != nil {
		return err
	}
	kh := filepath.Join(dir, "known_hosts")
	if err := os.WriteFile(kh, []byte(fmt.Sprintf("[%s]:%s %s\n", host, port, strings.TrimSpace(ci.PublicHostKey))), 0o600); err != nil {
		return err
	}
	args := []string{"-F", "/dev/null", "-p", port, "-i", key, "-o", "IdentitiesOnly=yes", "-o", "UserKnownHostsFile=" + kh,
		"-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ControlMaster=auto",
		"-o", "ControlPath=" + filepath.Join(dir, "cm-%C"), "-o", "ControlPersist=300", "-o", "LogLevel=ERROR", sshUser + "@" + host}
	sshRun := func(cmd string) error {
		c := exec.CommandContext(ctx, sshBin, append(slices.Clone(args), cmd)...)
		c.Env = r.e.vars
		var out bytes.Buffer
		c.Stdout, c.Stderr = &out, &out
		if err := c.Run(); err != nil {
			return fmt.Errorf("ssh: %w: %s", err, out.Bytes())
		}
		return nil
	}
	if err := sshRun("true"); err != nil { // starts the master
		r.note("baseline B skipped: %v", err)
		return nil
	}
	defer func() {
		c := exec.Command(sshBin, append(slices.Clone(args[:len(args)-1]), "-O", "exit", args[len(args)-1])...)
		_ = c.Run()
	}()
	var sshT, nookT []time.Duration
	var ratios []float64
	for i := -1; i < r.sz.n; i++ {
		start := time.Now()
		if err := sshRun("true"); err != nil {
			// A baseline, not the product: its failure is said, and the
			// other scenarios still run.
			r.note("baseline B stopped after %d samples: %v", len(sshT), err)
			break
		}
		a := time.Since(start)
		start = time.Now()
		if err := r.e.nook(ctx, repo, "exec", "--no-sync", "--", "true"); err != nil {
			return err
		}
		b := time.Since(start)
		if i >= 0 {
			sshT, nookT = append(sshT, a), append(nookT, b)
			ratios = append(ratios, float64(b)/float64(a))
		}
	}
	if len(sshT) == 0 {
		return nil
	}
	med, p95 := stats(sshT)
	r.add(Row{Scenario: "baseline B: OpenSSH ControlMaster `ssh true`", N: len(sshT), MedianMs: med, P95Ms: p95, ExecsPerCall: -1, ChansPerCall: -1, APIPerCall: -1})
	smed, sp95 := stats(nookT)
	slices.Sort(ratios)
	r.add(Row{Scenario: "exec --no-sync -- true, nook, paired with baseline B", N: len(nookT), MedianMs: smed, P95Ms: sp95, ExecsPerCall: -1, ChansPerCall: -1, APIPerCall: -1,
		Extra: map[string]float64{"paired_ratio_median": ratios[len(ratios)/2]}})
	return nil
}

// interval is when one command ran in the sandbox (its own clock).
type interval struct{ start, end int64 }

// stampArgv prints the sandbox's clock at the command's start and end.
var stampArgv = []string{"sh", "-c", "date +%s%N; date +%s%N"}

func parseStamps(out string) (interval, error) {
	f := strings.Fields(out)
	if len(f) != 2 {
		return interval{}, fmt.Errorf("want two timestamps, got %q", out)
	}
	a, err1 := strconv.ParseInt(f[0], 10, 64)
	b, err2 := strconv.ParseInt(f[1], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return interval{}, err
	}
	return interval{a, b}, nil
}

// overlaps counts commands that started before an earlier one ended.
// gapsBetween are the times from each command's end to the next one's
// start; it sorts iv by start.
func gapsBetween(iv []interval) []time.Duration {
	slices.SortFunc(iv, func(a, b interval) int { return int(a.start - b.start) })
	var gaps []time.Duration
	for i := 1; i < len(iv); i++ {
		gaps = append(gaps, time.Duration(iv[i].start-iv[i-1].end))
	}
	return gaps
}

func overlaps(iv []interval) int {
	slices.SortFunc(iv, func(a, b interval) int { return int(a.start - b.start) })
	n := 0
	var end int64
	for i, x := range iv {
		if i > 0 && x.start < end {
			n++
		}
		end = max(end, x.end)
	}
	return n
}

// concurrent: 32 callers on one sandbox, then 4 on each of the small
// sandboxes; the reference is what the agent serves on one kept connection,
// measured for as many execs as the 32 callers make, half just before them
// and half just after, so that both see the same machine.
func (r *runner) concurrent(ctx context.Context) error {
	one := r.tiny[0]
	ci, err := r.e.connInfo(ctx, r.runOf[one])
	if err != nil {
		return err
	}
	c, err := dialAgent(ci)
	if err != nil {
		return err
	}
	defer c.Close()
	// The command line the daemon sends for stampArgv (its argv quoted for
	// the agent's shell): the same work on the agent, so that the callers'
	// share of it compares the daemon with the agent, not two commands.
	line := stampArgv[0] + " " + stampArgv[1] + " '" + stampArgv[2] + "'"
	half := max(32*r.sz.concurrent/2, 10)
	var serial time.Duration
	var gaps []time.Duration
	direct := func() error {
		start := time.Now()
		var ivs []interval
		for range half {
			out, err := outputOn(c, line)
			if err != nil {
				return err
			}
			iv, err := parseStamps(out)
			if err != nil {
				return err
			}
			ivs = append(ivs, iv)
		}
		serial += time.Since(start)
		gaps = append(gaps, gapsBetween(ivs)...)
		return nil
	}
	if err := direct(); err != nil {
		return err
	}
	row, err := r.callers(ctx, fmt.Sprintf("32 callers on 1 sandbox x %d execs", r.sz.concurrent), []string{one}, 32)
	if err != nil {
		return err
	}
	if err := direct(); err != nil {
		return err
	}
	capacity := float64(2*half) / serial.Seconds()
	gap, _ := stats(gaps)
	r.add(Row{Scenario: "agent direct: serial sh -c 'date;date' on one kept connection", N: 2 * half, MedianMs: 1000 / capacity, ExecsPerCall: -1, ChansPerCall: -1, APIPerCall: -1,
		Extra: map[string]float64{"execs_per_s": capacity, "gap_ms": gap}, Note: "median is the mean, half before and half after the 32 callers"})
	row.Extra["of_agent_capacity"] = row.Extra["execs_per_s"] / capacity
	r.add(row)

	row, err = r.callers(ctx, fmt.Sprintf("4 callers on each of %d sandboxes x %d execs", r.sz.multi, r.sz.concurrent), r.tiny[:r.sz.multi], 4)
	if err != nil {
		return err
	}
	r.add(row)
	return nil
}

// callers runs per callers on each repo, each making r.sz.concurrent execs,
// and returns the row (execs_per_s in its Extra).
func (r *runner) callers(ctx context.Context, name string, repos []string, per int) (Row, error) {
	var ids []string
	for _, repo := range repos {
		ids = append(ids, r.runOf[repo])
	}
	before, err := r.e.counters(ctx, ids...)
	if err != nil {
		return Row{}, err
	}
	var mu sync.Mutex
	var lat []time.Duration
	stamps := map[string][]interval{}
	var errs []error
	var wg sync.WaitGroup
	start := time.Now()
	for _, repo := range repos {
		for range per {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range r.sz.concurrent {
					t0 := time.Now()
					var out bytes.Buffer
					res, err := r.e.client.Exec(ctx, execReq(repo), execOpts(&out))
					d := time.Since(t0)
					if err == nil && res.ExitCode != 0 {
						err = fmt.Errorf("exit %d", res.ExitCode)
					}
					var iv interval
					if err == nil {
						iv, err = parseStamps(out.String())
					}
					mu.Lock()
					if err != nil {
						errs = append(errs, err)
					} else {
						lat = append(lat, d)
						stamps[repo] = append(stamps[repo], iv)
					}
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	wall := time.Since(start)
	if err := errors.Join(errs...); err != nil {
		return Row{}, fmt.Errorf("%s: %w", name, err)
	}
	after, err := r.e.counters(ctx, ids...)
	if err != nil {
		return Row{}, err
	}
	total := len(lat)
	ov := 0
	var gaps []time.Duration
	for _, iv := range stamps {
		ov += overlaps(iv)
		gaps = append(gaps, gapsBetween(iv)...)
	}
	med, p95 := stats(lat)
	gap, _ := stats(gaps)
	tput := float64(total) / wall.Seconds()
	// gap_ms: from one command's end to the next one's start on the same
	// sandbox (median); the agent-direct row has the same for one client
	// running them back to back, without the daemon.
	row := Row{Scenario: name, N: total, MedianMs: med, P95Ms: p95,
		ExecsPerCall: float64(after.execs-before.execs) / float64(total), ChansPerCall: float64(after.chans-before.chans) / float64(total), APIPerCall: float64(after.api-before.api) / float64(total),
		Extra: map[string]float64{"execs_per_s": tput, "overlaps": float64(ov), "gap_ms": gap}}
	if ov > 0 {
		r.note("%s: %d commands overlapped on one sandbox (they must run one at a time)", name, ov)
	}
	return row, nil
}

// list: `nook list` with every session live (remote calls included).
func (r *runner) list(ctx context.Context) error {
	sessions := r.live + len(r.sz.repoFiles)
	row, err := r.measure(ctx, fmt.Sprintf("nook list, %d sessions", sessions), r.sz.nList, 1, 1, nil, func(int) error {
		return r.e.nook(ctx, r.root, "list")
	})
	if err != nil {
		return err
	}
	r.add(row)
	return nil
}

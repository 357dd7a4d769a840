package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
)

// sizes of the scenarios: full and quick.
type sizes struct {
	repoFiles    []int // synced-exec repositories
	n            int   // samples of a cheap scenario
	nSynced      map[int]int
	nStart       map[int]int // start --wait samples per repository
	bursts       int
	concurrent   int // execs per caller in the concurrency scenarios
	multi        int // sandboxes of the "4 on each" scenario
	liveRSS      int // live sandboxes for the RSS row
	listSessions int
	nList        int
	readySess    int
	nReady       int
}

var fullSizes = sizes{
	repoFiles: []int{200, 5000, 50000}, n: 30,
	nSynced: map[int]int{200: 15, 5000: 15, 50000: 15}, nStart: map[int]int{200: 5, 5000: 3, 50000: 2},
	bursts: 3, concurrent: 4, multi: 16, liveRSS: 100, listSessions: 200, nList: 7, readySess: 1000, nReady: 5,
}

var quickSizes = sizes{
	repoFiles: []int{200}, n: 5,
	nSynced: map[int]int{200: 3}, nStart: map[int]int{200: 2},
	bursts: 1, concurrent: 1, multi: 4, liveRSS: 8, listSessions: 12, nList: 2, readySess: 100, nReady: 2,
}

// withFiles makes the synced repositories those of files, taking the
// sample counts of the nearest size already set.
func (s *sizes) withFiles(files []int) {
	synced, start := map[int]int{}, map[int]int{}
	for _, f := range files {
		near := s.repoFiles[0]
		for _, k := range s.repoFiles {
			if abs(k-f) < abs(near-f) {
				near = k
			}
		}
		synced[f], start[f] = s.nSynced[near], s.nStart[near]
	}
	s.repoFiles, s.nSynced, s.nStart = slices.Clone(files), synced, start
}

func abs(n int) int { return max(n, -n) }

type runner struct {
	opts  Options
	sz    sizes
	e     *env
	res   *Result
	rtt   time.Duration
	root  string
	sized map[int]string    // files → repository
	runOf map[string]string // repository → run id
	tiny  []string          // small repositories, one sandbox each when started
	live  int               // tiny repositories with a sandbox
}

func (r *runner) logf(format string, a ...any) {
	if r.opts.Log != nil {
		fmt.Fprintf(r.opts.Log, "bench: "+format+"\n", a...)
	}
}

// Run runs every scenario and returns the results.
func Run(ctx context.Context, opts Options) (Result, error) {
	started := time.Now()
	res := Result{StartedAt: started.UTC(), Quick: opts.Quick, CPUs: runtime.NumCPU()}
	if len(opts.RTTs) == 0 {
		opts.RTTs = []time.Duration{0, 20 * time.Millisecond}
	}
	if len(opts.RWXRTTs) == 0 {
		opts.RWXRTTs = []time.Duration{0, 20 * time.Millisecond, 100 * time.Millisecond}
	}
	root, err := os.MkdirTemp("", "nookbench")
	if err != nil {
		return res, err
	}
	defer os.RemoveAll(root)
	r := &runner{opts: opts, sz: fullSizes, res: &res, root: root, sized: map[int]string{}, runOf: map[string]string{}}
	if opts.Quick {
		r.sz = quickSizes
	}
	if len(opts.Files) > 0 {
		r.sz.withFiles(opts.Files)
	}
	if err := r.run(ctx); err != nil {
		return res, err
	}
	res.Seconds = time.Since(started).Seconds()
	return res, nil
}

func (r *runner) run(ctx context.Context) error {
	e, err := newEnv(r.opts.Bin, filepath.Join(r.root, "user"))
	if err != nil {
		return err
	}
	r.e = e
	defer e.close()
	if err := e.startLocalcloud(ctx); err != nil {
		return err
	}
	if err := e.startDaemon(ctx); err != nil {
		return err
	}
	if r.wants("rss") {
		rss0, err := e.daemonRSS()
		if err != nil {
			return err
		}
		r.add(Row{Scenario: "daemon RSS, 0 sandboxes", N: 1, ExecsPerCall: -1, ChansPerCall: -1, APIPerCall: -1, Extra: map[string]float64{"rss_mib": rss0}})
	}
	if !r.wants("synced") && !r.wants("start") {
		// Only the small repository is used: the large ones take a
		// minute to make.
		r.sz.repoFiles = r.sz.repoFiles[:1]
	}

	r.logf("making repositories %v and %d small ones", r.sz.repoFiles, r.sz.listSessions)
	for _, n := range r.sz.repoFiles {
		dir := filepath.Join(r.root, "src", fmt.Sprintf("files%d", n))
		if err := e.makeRepo(dir, n); err != nil {
			return err
		}
		r.sized[n] = dir
	}
	if err := r.makeTiny(); err != nil {
		return err
	}
	r.logf("starting sandboxes")
	for _, n := range r.sz.repoFiles {
		if err := r.startSandbox(ctx, r.sized[n]); err != nil {
			return err
		}
	}
	if err := r.startTiny(ctx, r.sz.multi); err != nil {
		return err
	}
	if err := r.waitHelpers(ctx); err != nil {
		return err
	}

	for _, rtt := range r.opts.RTTs {
		r.rtt = rtt
		if err := e.setDelay(ctx, rtt/2); err != nil {
			return err
		}
		for i := range max(r.opts.Repeat, 1) {
			r.logf("scenarios at %s RTT (%d of %d)", rtt, i+1, max(r.opts.Repeat, 1))
			if err := r.perRTT(ctx); err != nil {
				return fmt.Errorf("at %s RTT: %w", rtt, err)
			}
		}
	}
	r.rtt = 0
	if err := e.setDelay(ctx, 0); err != nil {
		return err
	}
	if r.wants("rwx") {
		if err := r.rwxPath(ctx); err != nil {
			return fmt.Errorf("the RWX path: %w", err)
		}
	}

	// Live sandboxes: the RSS row, then the list rows.
	if r.wants("rss") {
		r.logf("starting sandboxes up to %d live", r.sz.liveRSS)
		if err := r.startTiny(ctx, r.sz.liveRSS-len(r.sz.repoFiles)); err != nil {
			return err
		}
		rss, err := e.daemonRSS()
		if err != nil {
			return err
		}
		r.add(Row{Scenario: fmt.Sprintf("daemon RSS, %d live sandboxes", r.live+len(r.sz.repoFiles)), N: 1, ExecsPerCall: -1, ChansPerCall: -1, APIPerCall: -1, Extra: map[string]float64{"rss_mib": rss}})
	}
	if r.wants("list") {
		r.logf("starting sandboxes up to %d sessions", r.sz.listSessions)
		if err := r.startTiny(ctx, r.sz.listSessions-len(r.sz.repoFiles)); err != nil {
			return err
		}
		for _, rtt := range r.opts.RTTs {
			r.rtt = rtt
			if err := e.setDelay(ctx, rtt/2); err != nil {
				return err
			}
			if err := r.list(ctx); err != nil {
				return err
			}
		}
		r.rtt = 0
		if err := e.setDelay(ctx, 0); err != nil {
			return err
		}
	}
	if r.wants("ready") {
		if err := r.ready(ctx); err != nil {
			return err
		}
	}
	r.ratios()
	return nil
}

// perRTT runs the scenarios that depend on the round-trip time.
func (r *runner) perRTT(ctx context.Context) error {
	small := r.sized[r.sz.repoFiles[0]]
	steps := []struct {
		group string
		run   func(context.Context) error
	}{
		{"no-sync", func(ctx context.Context) error { return r.execNoSync(ctx, small) }},
		{"synced", func(ctx context.Context) error { return r.execSynced(ctx) }},
		{"burst", func(ctx context.Context) error { return r.burst(ctx, small) }},
		{"agent", func(ctx context.Context) error { return r.agentDirect(ctx, small) }},
		{"baseline-a", func(ctx context.Context) error { return r.baselineA(ctx, small) }},
		{"baseline-b", func(ctx context.Context) error { return r.baselineB(ctx, small) }},
		{"callers", func(ctx context.Context) error { return r.concurrent(ctx) }},
		{"start", func(ctx context.Context) error { return r.startWait(ctx) }},
		// Last: it replaces the small sandbox's connection.
		{"silence", func(ctx context.Context) error { return r.silenceRows(ctx, small) }},
	}
	for _, step := range steps {
		if !r.wants(step.group) {
			continue
		}
		if err := step.run(ctx); err != nil {
			return err
		}
	}
	return nil
}

// wants says the scenario group is to run (Options.Only).
func (r *runner) wants(group string) bool {
	return len(r.opts.Only) == 0 || slices.Contains(r.opts.Only, group)
}

func (r *runner) add(row Row) {
	row.RTTms = int(r.rtt.Milliseconds())
	if r.rtt > 0 && row.MedianMs > 0 {
		row.RTTs = row.MedianMs / float64(r.rtt.Milliseconds())
	}
	r.res.Rows = append(r.res.Rows, row)
	r.logf("%-55s rtt=%3dms median=%8.2fms p95=%8.2fms execs/call=%.2f", row.Scenario, row.RTTms, row.MedianMs, row.P95Ms, row.ExecsPerCall)
}

func (r *runner) note(format string, a ...any) {
	r.res.Notes = append(r.res.Notes, fmt.Sprintf(format, a...))
}

// measure times fn n times after warm calls, with localcloud's counters of
// runIDs read around the timed calls; calls is how many calls one fn makes.
func (r *runner) measure(ctx context.Context, name string, n, warm, calls int, runIDs []string, fn func(i int) error) (Row, error) {
	for i := range warm {
		if err := fn(-1 - i); err != nil {
			return Row{}, fmt.Errorf("%s (warm-up): %w", name, err)
		}
	}
	before, err := r.e.counters(ctx, runIDs...)
	if err != nil {
		return Row{}, err
	}
	samples := make([]time.Duration, 0, n)
	for i := range n {
		start := time.Now()
		if err := fn(i); err != nil {
			return Row{}, fmt.Errorf("%s: %w", name, err)
		}
		samples = append(samples, time.Since(start))
	}
	after, err := r.e.counters(ctx, runIDs...)
	if err != nil {
		return Row{}, err
	}
	med, p95 := stats(samples)
	per := func(a, b int64) float64 { return float64(b-a) / float64(n*calls) }
	row := Row{Scenario: name, N: n, MedianMs: med, P95Ms: p95, ExecsPerCall: per(before.execs, after.execs), ChansPerCall: per(before.chans, after.chans), APIPerCall: per(before.api, after.api)}
	if len(runIDs) == 0 {
		row.ExecsPerCall, row.ChansPerCall = -1, -1
	}
	return row, nil
}

// startSandbox starts (and waits for) the sandbox of repo.
func (r *runner) startSandbox(ctx context.Context, repo string) error {
	resp, err := r.e.client.Start(ctx, ipc.StartRequest{Target: ipc.Target{Cwd: repo}, Wait: true})
	if err != nil {
		return fmt.Errorf("start the sandbox of %s: %w", repo, err)
	}
	r.runOf[repo] = resp.Session.RunID
	return nil
}

// makeTiny makes the small repositories: one made with git, the others
// copied from it.
func (r *runner) makeTiny() error {
	tmpl := filepath.Join(r.root, "src", "tiny-template")
	if err := r.e.makeRepo(tmpl, 3); err != nil {
		return err
	}
	for i := range r.sz.listSessions {
		dir := filepath.Join(r.root, "src", fmt.Sprintf("tiny%03d", i))
		if err := copyTree(tmpl, dir); err != nil {
			return err
		}
		r.tiny = append(r.tiny, dir)
	}
	return nil
}

// startTiny starts sandboxes until n small repositories have one, four at a
// time.
func (r *runner) startTiny(ctx context.Context, n int) error {
	n = min(n, len(r.tiny))
	if n <= r.live {
		return nil
	}
	todo := r.tiny[r.live:n]
	ids := make([]string, len(todo))
	errs := make([]error, len(todo))
	sem := make(chan struct{}, 4)
	var wg sync.WaitGroup
	for i, repo := range todo {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			resp, err := r.e.client.Start(ctx, ipc.StartRequest{Target: ipc.Target{Cwd: repo}, Wait: true})
			ids[i], errs[i] = resp.Session.RunID, err
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("start small sandboxes: %w", err)
	}
	for i, repo := range todo {
		r.runOf[repo] = ids[i]
	}
	r.live = n
	return nil
}

// libExec runs argv through the client library.
// waitHelpers syncs every live sandbox once and waits until its sandbox
// helper serves (the daemon says so): the first sync starts the helper in
// the background, and it walks the checkout to place its watches, work
// that would otherwise weigh on the first scenarios' times
// (docs/performance.md).
func (r *runner) waitHelpers(ctx context.Context) error {
	late := false // after one helper did not start, the others are not waited for
	for repo, id := range r.runOf {
		if _, err := r.libExec(ctx, repo, false, "true"); err != nil {
			return fmt.Errorf("connect to the sandbox of %s: %w", repo, err)
		}
		if late {
			continue
		}
		served, err := r.waitFor(ctx, func() (bool, error) { return r.e.helperServes(ctx, id), nil })
		if err != nil {
			return err
		}
		if !served {
			late = true
			r.note("the sandbox helper of %s did not start within %s: its rows measure the plain sync", repo, waitLimit)
		}
	}
	return nil
}

// waitLimit bounds what waitFor waits.
const waitLimit = 2 * time.Minute

// waitFor polls done until it says so (true), or for waitLimit (false).
func (r *runner) waitFor(ctx context.Context, done func() (bool, error)) (bool, error) {
	deadline := time.Now().Add(waitLimit)
	for {
		ok, err := done()
		if ok || err != nil {
			return ok, err
		}
		if time.Now().After(deadline) {
			return false, nil
		}
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// cpuReferences are what nook's CPU per exec compares with: the CPU of
// `nook --help` (the process alone: Go's start, parsing, exit) and of
// sleep(1) waiting as long as an exec took (what this machine charges any
// process for waiting: on a VM, waking up from a wait is not free).
func (r *runner) cpuReferences(ctx context.Context, dir string, waitMs float64) (floor, waiting float64, err error) {
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		return 0, 0, fmt.Errorf("find sleep(1) for the CPU reference: %w", err)
	}
	var help, slept []time.Duration
	for range r.sz.n {
		if err := r.e.nook(ctx, dir, "--help"); err != nil {
			return 0, 0, err
		}
		help = append(help, r.e.lastCPU)
		cmd := exec.CommandContext(ctx, sleep, strconv.FormatFloat(waitMs/1000, 'f', 4, 64))
		if err := cmd.Run(); err != nil {
			return 0, 0, fmt.Errorf("sleep for the CPU reference: %w", err)
		}
		slept = append(slept, cmd.ProcessState.UserTime()+cmd.ProcessState.SystemTime())
	}
	floor, _ = stats(help)
	waiting, _ = stats(slept)
	return floor, waiting, nil
}

func (r *runner) libExec(ctx context.Context, repo string, noSync bool, argv ...string) (ipc.ExecResult, error) {
	res, err := r.e.client.Exec(ctx, ipc.ExecRequest{Target: ipc.Target{Cwd: repo}, Argv: argv, NoSync: noSync}, client.ExecOptions{})
	if err == nil && res.ExitCode != 0 {
		err = fmt.Errorf("%v exited %d", argv, res.ExitCode)
	}
	return res, err
}

func (r *runner) execNoSync(ctx context.Context, repo string) error {
	ids := []string{r.runOf[repo]}
	var cpu []time.Duration
	row, err := r.measure(ctx, "exec --no-sync -- true, nook", r.sz.n, 2, 1, ids, func(i int) error {
		err := r.e.nook(ctx, repo, "exec", "--no-sync", "--", "true")
		if i >= 0 {
			cpu = append(cpu, r.e.lastCPU)
		}
		return err
	})
	if err != nil {
		return err
	}
	med, _ := stats(cpu)
	floor, waiting, err := r.cpuReferences(ctx, repo, row.MedianMs)
	if err != nil {
		return err
	}
	row.Extra = map[string]float64{"nook_cpu_ms": med, "nook_help_cpu_ms": floor, "sleep_cpu_ms": waiting}
	r.add(row)
	row, err = r.measure(ctx, "exec --no-sync -- true, client library", r.sz.n, 2, 1, ids, func(int) error {
		_, err := r.libExec(ctx, repo, true, "true")
		return err
	})
	if err != nil {
		return err
	}
	r.add(row)
	return nil
}

// execSynced: one changed file (a new content each call) in each size.
func (r *runner) execSynced(ctx context.Context) error {
	for _, files := range r.sz.repoFiles {
		repo := r.sized[files]
		ids := []string{r.runOf[repo]}
		n := r.sz.nSynced[files]
		change := func(tag string, i int) error {
			return os.WriteFile(filepath.Join(repo, "README.md"), []byte("change "+tag+" "+strconv.Itoa(i)+"\n"), 0o644)
		}
		name := fmt.Sprintf("synced exec -- true, 1 changed file, %d files", files)
		row, err := r.measureChanged(ctx, name+", nook", n, ids, change, "nook", func() error {
			return r.e.nook(ctx, repo, "exec", "--", "true")
		})
		if err != nil {
			return err
		}
		r.add(row)
		row, err = r.measureChanged(ctx, name+", client library", n, ids, change, "lib", func() error {
			_, err := r.libExec(ctx, repo, false, "true")
			return err
		})
		if err != nil {
			return err
		}
		r.add(row)
		// An agent running its tests again without an edit in between.
		same := func(string, int) error { return nil }
		row, err = r.measureChanged(ctx, fmt.Sprintf("synced exec -- true, nothing changed since the last exec, %d files, nook", files), n, ids, same, "same", func() error {
			return r.e.nook(ctx, repo, "exec", "--", "true")
		})
		if err != nil {
			return err
		}
		r.add(row)
	}
	return nil
}

// measureChanged is measure with a file change made before each call,
// outside the timing.
func (r *runner) measureChanged(ctx context.Context, name string, n int, ids []string, change func(string, int) error, tag string, call func() error) (Row, error) {
	if err := change(tag, -1); err != nil {
		return Row{}, err
	}
	if err := call(); err != nil { // warm: the first push of this content
		return Row{}, fmt.Errorf("%s (warm-up): %w", name, err)
	}
	var samples []time.Duration
	before, err := r.e.counters(ctx, ids...)
	if err != nil {
		return Row{}, err
	}
	for i := range n {
		if err := change(tag, i); err != nil {
			return Row{}, err
		}
		start := time.Now()
		if err := call(); err != nil {
			return Row{}, fmt.Errorf("%s: %w", name, err)
		}
		samples = append(samples, time.Since(start))
	}
	after, err := r.e.counters(ctx, ids...)
	if err != nil {
		return Row{}, err
	}
	med, p95 := stats(samples)
	return Row{Scenario: name, N: n, MedianMs: med, P95Ms: p95,
		ExecsPerCall: float64(after.execs-before.execs) / float64(n), ChansPerCall: float64(after.chans-before.chans) / float64(n), APIPerCall: float64(after.api-before.api) / float64(n)}, nil
}

// burst: 20 back-to-back execs through the client library.
func (r *runner) burst(ctx context.Context, repo string) error {
	const size = 20
	var each []time.Duration // every timed exec, for the p95 an exec of a burst sees
	row, err := r.measure(ctx, "burst of 20 execs --no-sync, client library (per burst)", r.sz.bursts, 1, size, []string{r.runOf[repo]}, func(i int) error {
		for range size {
			start := time.Now()
			if _, err := r.libExec(ctx, repo, true, "true"); err != nil {
				return err
			}
			if i >= 0 {
				each = append(each, time.Since(start))
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	med, p95 := stats(each)
	row.Extra = map[string]float64{"per_exec_ms": row.MedianMs / size, "exec_median_ms": med, "exec_p95_ms": p95}
	row.Note = "counters per exec"
	r.add(row)
	return nil
}

package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/sandboxd/sandboxd/internal/userenv"
	"github.com/sandboxd/sandboxd/ipc/client"
	"github.com/sandboxd/sandboxd/localcloud"
	"github.com/sandboxd/sandboxd/localcloud/agent"
	"github.com/sandboxd/sandboxd/rwxapi"
)

// env is one isolated user: its own HOME, XDG directories, socket,
// localcloud and daemon, all under root.
type env struct {
	bin  string
	root string
	vars []string

	lc      *exec.Cmd
	lcDone  chan struct{}
	daemon  *exec.Cmd
	dDone   chan struct{}
	dLog    *bytes.Buffer
	client  *client.Client
	lcHTTP  *http.Client
	lcToken string
	lcAPI   string
	lcCert  string        // the API's certificate (SSL_CERT_FILE of an RWX-path daemon)
	lastCPU time.Duration // user+system CPU of the last nook run
}

func newEnv(bin, root string) (*env, error) {
	vars, err := userenv.Vars(root, bin, "bench")
	if err != nil {
		return nil, err
	}
	return &env{bin: bin, root: root, vars: vars}, nil
}

func (e *env) get(key string) string { return userenv.Get(e.vars, key) }

func (e *env) socket() string { return userenv.Socket(e.vars) }

func (e *env) localcloudDir() string {
	return filepath.Join(e.get("XDG_DATA_HOME"), "sandboxd", "localcloud")
}

// startLocalcloud runs sandboxd-localcloud in the foreground of a child
// process, where the daemon will find it.
func (e *env) startLocalcloud(ctx context.Context) error {
	dir := e.localcloudDir()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	logf, err := os.Create(filepath.Join(e.root, "localcloud.out"))
	if err != nil {
		return err
	}
	e.lc = exec.Command(filepath.Join(e.bin, "sandboxd-localcloud"), "serve", "--state-dir", dir, "--enable-fault-injection") // the one-way delay is set through /admin/faults
	e.lc.Env = e.vars
	e.lc.Stdout, e.lc.Stderr = logf, logf
	if err := e.lc.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start sandboxd-localcloud: %w", err)
	}
	logf.Close()
	e.lcDone = make(chan struct{})
	go func() { _ = e.lc.Wait(); close(e.lcDone) }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		d, err := localcloud.Status(ctx, dir)
		if err == nil && d.PID == e.lc.Process.Pid {
			hc, tok, err := d.Client()
			if err != nil {
				return err
			}
			hc.Timeout = time.Minute
			e.lcHTTP, e.lcToken, e.lcAPI, e.lcCert = hc, tok, d.APIURL, d.CertFile
			return nil
		}
		select {
		case <-e.lcDone:
			return fmt.Errorf("sandboxd-localcloud exited early; see %s", filepath.Join(e.root, "localcloud.out"))
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("sandboxd-localcloud did not serve within 30s: %v", err)
		}
	}
}

// startDaemon runs sandboxd in a child process and waits for its socket.
func (e *env) startDaemon(ctx context.Context, extra ...string) error {
	e.dLog = &bytes.Buffer{}
	e.daemon = exec.Command(filepath.Join(e.bin, "sandboxd"))
	e.daemon.Env = append(append([]string(nil), e.vars...), extra...)
	e.daemon.Stdout, e.daemon.Stderr = e.dLog, e.dLog
	if err := e.daemon.Start(); err != nil {
		return fmt.Errorf("start sandboxd: %w", err)
	}
	e.dDone = make(chan struct{})
	go func() { _ = e.daemon.Wait(); close(e.dDone) }()
	e.client = client.New(e.socket(), client.WithUserAgent("sandboxd-bench"))
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := e.client.Health(ctx); err == nil {
			return nil
		}
		select {
		case <-e.dDone:
			return fmt.Errorf("sandboxd exited early:\n%s", e.dLog)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("sandboxd did not answer within 30s:\n%s", e.dLog)
		}
	}
}

// close stops the daemon and localcloud (SIGTERM, then SIGKILL).
func (e *env) close() {
	stop := func(cmd *exec.Cmd, done chan struct{}) {
		if cmd == nil || cmd.Process == nil {
			return
		}
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	}
	if e.client != nil {
		e.client.Close()
	}
	stop(e.daemon, e.dDone)
	stop(e.lc, e.lcDone)
	// A localcloud the daemon may have started itself (READY scenario).
	if d, err := localcloud.ReadDiscovery(e.localcloudDir()); err == nil && (e.lc == nil || d.PID != e.lc.Process.Pid) {
		_, _ = localcloud.Stop(context.Background(), e.localcloudDir(), 10*time.Second)
	}
}

// lc calls localcloud's API with the access token.
func (e *env) lcCall(ctx context.Context, method, path string, body, out any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, e.lcAPI+path, rd)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+e.lcToken)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := e.lcHTTP.Do(req)
	if err != nil {
		return fmt.Errorf("localcloud %s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("localcloud %s %s: %s: %s", method, path, resp.Status, b)
	}
	if out != nil {
		return json.Unmarshal(b, out)
	}
	return nil
}

// setDelay sets localcloud's one-way delay (the RTT grows by twice it).
func (e *env) setDelay(ctx context.Context, d time.Duration) error {
	return e.lcCall(ctx, http.MethodPost, "/admin/faults", map[string]int64{"one_way_delay_ms": d.Milliseconds()}, nil)
}

// counters are what localcloud counted: SSH per run, API in total.
type counters struct {
	execs, chans, conns, api int64
}

func (e *env) counters(ctx context.Context, runIDs ...string) (counters, error) {
	var c counters
	for _, id := range runIDs {
		var st agent.Stats
		if err := e.lcCall(ctx, http.MethodGet, "/admin/runs/"+id+"/ssh-stats", nil, &st); err != nil {
			return c, err
		}
		c.execs += st.ExecRequests
		c.chans += st.ChannelOpens
		c.conns += st.Connections
	}
	var h localcloud.Health
	if err := e.lcCall(ctx, http.MethodGet, "/localcloud/health", nil, &h); err != nil {
		return c, err
	}
	c.api = h.APIRequests
	return c, nil
}

func (e *env) connInfo(ctx context.Context, runID string) (rwxapi.ConnectionInfo, error) {
	var ci rwxapi.ConnectionInfo
	err := e.lcCall(ctx, http.MethodGet, rwxapi.PathConnectionInfo+"?sandbox_key="+runID, nil, &ci)
	return ci, err
}

// nook runs the nook binary in dir; a non-zero exit is an error.
func (e *env) nook(ctx context.Context, dir string, args ...string) error {
	cmd := exec.CommandContext(ctx, filepath.Join(e.bin, "nook"), args...)
	cmd.Dir = dir
	cmd.Env = e.vars
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("nook %s in %s: %w\n%s", strings.Join(args, " "), dir, err, out.Bytes())
	}
	e.lastCPU = cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	return nil
}

// rss is the resident set of the daemon, in MiB.
func (e *env) daemonRSS() (float64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(e.daemon.Process.Pid) + "/status")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			if err != nil {
				return 0, err
			}
			return float64(kb) / 1024, nil
		}
	}
	return 0, fmt.Errorf("no VmRSS in /proc/%d/status", e.daemon.Process.Pid)
}

// git runs git in dir.
func (e *env) git(dir string, args ...string) error {
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	cmd.Env = e.vars
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("git %s in %s: %w\n%s", strings.Join(args, " "), dir, err, out)
	}
	return nil
}

// sandboxConfig names its base, as the RWX CLI wants (it would write one
// into the file otherwise, a change in the working tree).
const sandboxConfig = "base:\n  image: ubuntu:24.04\n  config: rwx/base 1.0.0\n\ntasks:\n  - key: sandbox\n    run: rwx-sandbox\n"

// makeRepo creates a committed repository of n files (100 per directory)
// plus a README and the sandbox config, its own origin.
func (e *env) makeRepo(dir string, n int) error {
	if err := os.MkdirAll(filepath.Join(dir, ".rwx"), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, ".rwx", "sandbox.yml"), []byte(sandboxConfig), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "README.md"), []byte("bench\n"), 0o644); err != nil {
		return err
	}
	for i := range n {
		sub := filepath.Join(dir, "src", fmt.Sprintf("d%03d", i/100))
		if i%100 == 0 {
			if err := os.MkdirAll(sub, 0o755); err != nil {
				return err
			}
		}
		if err := os.WriteFile(filepath.Join(sub, fmt.Sprintf("f%05d.txt", i)), []byte(fmt.Sprintf("file %d\n", i)), 0o644); err != nil {
			return err
		}
	}
	if err := e.git(dir, "init", "-q", "-b", "main"); err != nil {
		return err
	}
	if err := e.git(dir, "add", "-A"); err != nil {
		return err
	}
	// Packed, as a user's repository is, and now: git's automatic gc,
	// which a commit of 50,000 loose objects starts in the background,
	// would otherwise pack them under the first sandbox's clone (a clone by
	// path then fails and is made again through git's transport, much
	// slower, and the start --wait rows swing with it).
	if err := e.git(dir, "-c", "gc.auto=0", "commit", "-q", "-m", "init"); err != nil {
		return err
	}
	if err := e.git(dir, "gc", "-q"); err != nil {
		return err
	}
	// An origin that has the commit, as the RWX CLI needs to start a
	// sandbox (it clones from origin): the repository itself.
	if err := e.git(dir, "remote", "add", "origin", dir); err != nil {
		return err
	}
	return e.git(dir, "fetch", "-q", "origin")
}

// copyTree copies a small directory tree (a template repository).
func copyTree(src, dst string) error {
	return filepath.Walk(src, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		target := filepath.Join(dst, rel)
		if info.IsDir() {
			return os.MkdirAll(target, info.Mode().Perm())
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(target, b, info.Mode().Perm())
	})
}

// helperServes reports whether the daemon says the sandbox helper serves
// in run's sandbox (doctor's helper check): the server's socket comes a
// round trip before the daemon hears of it.
func (e *env) helperServes(ctx context.Context, run string) bool {
	d, err := e.client.Doctor(ctx)
	if err != nil {
		return false
	}
	for _, c := range d.Checks {
		if c.Name == "helper "+run && c.OK && strings.HasPrefix(c.Detail, "serving") {
			return true
		}
	}
	return false
}

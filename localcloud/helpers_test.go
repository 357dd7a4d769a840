package localcloud

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/internal/testutil"
	"github.com/sandboxd/sandboxd/localcloud/runs"
	"github.com/sandboxd/sandboxd/localcloud/sandbox"
	"github.com/sandboxd/sandboxd/rwxapi"
	"golang.org/x/crypto/ssh"
)

// asBinaryEnv makes the test binary behave as `sandboxd-localcloud serve`
// (used to SIGKILL a real server process and by the EnsureRunning tests).
const asBinaryEnv = "LOCALCLOUD_TEST_AS_BINARY"

// allocEnv makes the test binary allocate and touch that many bytes.
const allocEnv = "LOCALCLOUD_TEST_ALLOC"

func TestMain(m *testing.M) {
	if os.Getenv(asBinaryEnv) == "1" {
		os.Exit(serveForTest(os.Args[1:]))
	}
	if port := os.Getenv(listenEnv); port != "" {
		os.Exit(listenOnce(port))
	}
	if n, err := strconv.Atoi(os.Getenv(allocEnv)); err == nil {
		// In a sandbox: use n bytes of memory.
		b := make([]byte, n)
		for i := range b {
			b[i] = 1
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// listenEnv makes the test binary (in a sandbox) listen on 127.0.0.1:port,
// say "listening", and answer one connection with "inside".
const listenEnv = "LOCALCLOUD_TEST_LISTEN"

func listenOnce(port string) int {
	ln, err := net.Listen("tcp", "127.0.0.1:"+port)
	if err != nil {
		fmt.Println(err)
		return 1
	}
	fmt.Println("listening")
	c, err := ln.Accept()
	if err != nil {
		return 1
	}
	c.Write([]byte("inside\n"))
	c.Close()
	return 0
}

func serveForTest(args []string) int {
	if len(args) == 0 || args[0] != "serve" {
		fmt.Fprintln(os.Stderr, "test server: want `serve`")
		return 2
	}
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	dir := fs.String("state-dir", "", "")
	idle := fs.Duration("idle-timeout", 0, "")
	isolation := fs.String("isolation", "", "")
	if err := fs.Parse(args[1:]); err != nil {
		return 2
	}
	srv, err := New(Config{Dir: *dir, IdleTimeout: *idle, Sandbox: sandbox.Options{Isolation: *isolation}})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := srv.Start(ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		if errors.Is(err, ErrAlreadyRunning) {
			return ExitAlreadyRunning
		}
		return 1
	}
	<-ctx.Done()
	if err := srv.Close(context.Background()); err != nil {
		return 1
	}
	return 0
}

// isolate points HOME and the XDG directories at temporary ones.
func isolate(t testing.TB) string {
	t.Helper()
	root := t.TempDir()
	for _, k := range []string{"HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR"} {
		d := filepath.Join(root, strings.ToLower(k))
		os.MkdirAll(d, 0o700)
		t.Setenv(k, d)
	}
	t.Setenv("GIT_CONFIG_NOSYSTEM", "1")
	return root
}

type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// client talks to a server over HTTPS with its certificate.
type client struct {
	t     testing.TB
	base  string
	token string
	http  *http.Client
}

func newClient(t testing.TB, srv *Server) *client {
	return &client{t: t, base: srv.APIURL(), token: srv.AccessToken(), http: &http.Client{
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: srv.CertPool()}},
		Timeout:   30 * time.Second,
	}}
}

// raw sends body (a []byte is sent as is) and returns status and body.
func (c *client) raw(method, path string, body any, headers ...string) (int, []byte) {
	c.t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case []byte:
		rd = bytes.NewReader(b)
	default:
		j, err := json.Marshal(b)
		if err != nil {
			c.t.Fatal(err)
		}
		rd = bytes.NewReader(j)
	}
	req, err := http.NewRequest(method, c.base+path, rd)
	if err != nil {
		c.t.Fatal(err)
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := c.http.Do(req)
	if err != nil {
		c.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// call expects status want and decodes the answer into out (if not nil).
func (c *client) call(want int, method, path string, body, out any, headers ...string) {
	c.t.Helper()
	status, b := c.raw(method, path, body, headers...)
	if status != want {
		c.t.Fatalf("%s %s: status %d, want %d: %s", method, path, status, want, b)
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			c.t.Fatalf("%s %s: decode %s: %v", method, path, b, err)
		}
	}
}

func (c *client) create(def rwxapi.RunDefinition, key string) string {
	c.t.Helper()
	var res rwxapi.CreateRunResult
	var hdr []string
	if key != "" {
		hdr = []string{rwxapi.HeaderIdempotencyKey, key}
	}
	c.call(http.StatusCreated, "POST", rwxapi.PathRuns, rwxapi.CreateRunRequest{Run: def}, &res, hdr...)
	if res.RunID == "" || !strings.HasSuffix(res.RunURL, "/runs/"+res.RunID) {
		c.t.Fatalf("create answered %+v", res)
	}
	return res.RunID
}

func (c *client) status(id string) RunStatus {
	c.t.Helper()
	var st RunStatus
	c.call(http.StatusOK, "GET", rwxapi.PathRuns+"/"+id, nil, &st)
	return st
}

// waitState polls until the run leaves provisioning (or reaches want).
func (c *client) waitState(id string, want runs.State) RunStatus {
	c.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		st := c.status(id)
		if st.State == want {
			return st
		}
		if st.State == runs.Completed || time.Now().After(deadline) {
			c.t.Fatalf("run %s is %s (%s %s), want %s", id, st.State, st.Reason, st.Detail, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (c *client) connInfo(id string) rwxapi.ConnectionInfo {
	c.t.Helper()
	var ci rwxapi.ConnectionInfo
	c.call(http.StatusOK, "GET", rwxapi.PathConnectionInfo+"?sandbox_key="+id, nil, &ci)
	return ci
}

// sshDial connects the way the RWX CLI does.
func sshDial(ci rwxapi.ConnectionInfo) (*ssh.Client, error) {
	key, err := ssh.ParsePrivateKey([]byte(ci.PrivateUserKey))
	if err != nil {
		return nil, err
	}
	host, _, _, _, err := ssh.ParseAuthorizedKey([]byte(ci.PublicHostKey))
	if err != nil {
		return nil, err
	}
	return ssh.Dial("tcp", ci.Address, &ssh.ClientConfig{
		User:            "rwx-cli",
		Auth:            []ssh.AuthMethod{ssh.PublicKeys(key)},
		HostKeyCallback: ssh.FixedHostKey(host),
		Timeout:         10 * time.Second,
	})
}

func dialSandbox(t testing.TB, ci rwxapi.ConnectionInfo) *ssh.Client {
	t.Helper()
	c, err := sshDial(ci)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func output(t testing.TB, c *ssh.Client, command string) (string, int) {
	t.Helper()
	s, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	out, err := s.CombinedOutput(command)
	var exit *ssh.ExitError
	switch {
	case err == nil:
		return string(out), 0
	case errors.As(err, &exit):
		return string(out), exit.ExitStatus()
	}
	t.Fatalf("run %q: %v", command, err)
	return "", -1
}

const plainConfig = "tasks:\n  - key: sandbox\n    run: rwx-sandbox\n"

// repo makes a repository pushed to a bare origin and returns a run
// definition for it with config as the sandbox config.
func repo(t testing.TB, config string) rwxapi.RunDefinition {
	t.Helper()
	root := t.TempDir()
	src := filepath.Join(root, "src")
	os.MkdirAll(filepath.Join(src, ".rwx"), 0o755)
	testutil.Git(t, src, "init", "-q", "-b", "main")
	os.WriteFile(filepath.Join(src, "README"), []byte("hello\n"), 0o644)
	os.WriteFile(filepath.Join(src, ".rwx", "sandbox.yml"), []byte(config), 0o644)
	testutil.Git(t, src, "add", ".")
	testutil.Git(t, src, "commit", "-q", "-m", "init")
	origin := filepath.Join(root, "origin.git")
	testutil.Git(t, root, "clone", "-q", "--bare", src, origin)
	state := rwxapi.CLIState{Branch: "main", ConfigFile: filepath.Join(src, ".rwx", "sandbox.yml")}
	return rwxapi.RunDefinition{
		Title:           "Sandbox: src (main)",
		CLIState:        state.Encode(),
		Git:             rwxapi.GitMetadata{Branch: "main", Sha: testutil.Git(t, src, "rev-parse", "HEAD"), OriginURL: origin},
		TaskDefinitions: []rwxapi.DirectoryEntry{{Path: ".rwx/sandbox.yml", Type: "file", Permissions: 0o644, FileContents: config}},
		MintDirectory:   []rwxapi.DirectoryEntry{{Path: ".rwx", Type: "dir", Permissions: 0o755}, {Path: ".rwx/sandbox.yml", Type: "file", Permissions: 0o644, FileContents: config}},
		UseCache:        true,
		Patch:           json.RawMessage(`{"sent":false,"lfs_files":null,"lfs_count":0,"untracked_files":null,"untracked_count":0,"git_directory":true,"git_installed":true}`),
	}
}

// startServer runs an in-process server on a fresh state directory.
func startServer(t testing.TB, cfg Config) *Server {
	t.Helper()
	if cfg.Dir == "" {
		cfg.Dir = filepath.Join(t.TempDir(), "state")
	}
	// The tests inject faults; TestFaultInjectionNeedsItsFlag checks the
	// default.
	cfg.EnableFaultInjection = true
	srv, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close(context.Background()) })
	return srv
}

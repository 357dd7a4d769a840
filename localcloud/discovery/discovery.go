// Package discovery is how a client finds, starts and stops the local
// runs API (sandboxd-localcloud) of a state directory: the discovery file,
// the pid and health check, the start command. It is all the daemon links
// of localcloud; the server itself stays in package localcloud.
package discovery

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/sandboxd/sandboxd/localcloud/sandbox"
)

// Discovery is the content of <state dir>/localcloud.json: how clients
// find a running server.
type Discovery struct {
	APIURL    string    `json:"api_url"`
	HTTPURL   string    `json:"http_url,omitempty"`
	CertFile  string    `json:"cert_file"`
	TokenFile string    `json:"token_file"`
	PID       int       `json:"pid"`
	Version   string    `json:"version"`
	StartedAt time.Time `json:"started_at"`
	StateDir  string    `json:"state_dir"`
	LogFile   string    `json:"log_file"`
	// Isolation says which protections the server's sandboxes have.
	Isolation *sandbox.Report `json:"isolation,omitempty"`
}

// Host is host:port of the API (what RWX_HOST takes).
func (d Discovery) Host() string { return strings.TrimPrefix(d.APIURL, "https://") }

// Files inside the state directory.
const (
	File    = "localcloud.json"
	LogFile = "localcloud.log"
)

// ErrNotRunning means no live server was found.
var ErrNotRunning = errors.New("sandboxd-localcloud is not running")

// ExitAlreadyRunning is the exit code of `serve` when another server holds
// the state directory.
const ExitAlreadyRunning = 3

// Read reads the discovery file of state directory dir. A missing
// file is ErrNotRunning.
func Read(dir string) (Discovery, error) {
	path := filepath.Join(dir, File)
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return Discovery{}, fmt.Errorf("%w (no %s)", ErrNotRunning, path)
	}
	if err != nil {
		return Discovery{}, fmt.Errorf("read %s: %w", path, err)
	}
	var d Discovery
	if err := json.Unmarshal(b, &d); err != nil || d.APIURL == "" || d.PID <= 0 {
		return Discovery{}, fmt.Errorf("%w: the discovery file %s is damaged", ErrNotRunning, path)
	}
	return d, nil
}

// Client returns an HTTPS client that trusts the server's certificate, and
// the access token.
func (d Discovery) Client() (*http.Client, string, error) {
	pem, err := os.ReadFile(d.CertFile)
	if err != nil {
		return nil, "", fmt.Errorf("read the certificate %s: %w", d.CertFile, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, "", fmt.Errorf("the certificate file %s holds no certificate", d.CertFile)
	}
	tok, err := os.ReadFile(d.TokenFile)
	if err != nil {
		return nil, "", fmt.Errorf("read the access token %s: %w", d.TokenFile, err)
	}
	c := &http.Client{
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}},
		Timeout:   5 * time.Second,
	}
	return c, strings.TrimSpace(string(tok)), nil
}

// Check tells whether the server of d is alive: its pid exists and its API
// answers as that pid.
func (d Discovery) Check(ctx context.Context) error {
	if !processAlive(d.PID) {
		return fmt.Errorf("%w (pid %d is gone)", ErrNotRunning, d.PID)
	}
	c, token, err := d.Client()
	if err != nil {
		return fmt.Errorf("%w: %v", ErrNotRunning, err)
	}
	defer c.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, d.APIURL+"/localcloud/health", nil)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrNotRunning, err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := c.Do(req)
	if err != nil {
		return fmt.Errorf("%w: its API at %s does not answer: %v", ErrNotRunning, d.APIURL, err)
	}
	defer resp.Body.Close()
	var h struct {
		PID int `json:"pid"`
	}
	if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&h) != nil {
		return fmt.Errorf("%w: its API at %s answered %s", ErrNotRunning, d.APIURL, resp.Status)
	}
	if h.PID != d.PID {
		return fmt.Errorf("%w: %s is served by pid %d, not %d", ErrNotRunning, d.APIURL, h.PID, d.PID)
	}
	return nil
}

// Status returns the discovery of a live server in dir, or an error
// wrapping ErrNotRunning.
func Status(ctx context.Context, dir string) (Discovery, error) {
	d, err := Read(dir)
	if err != nil {
		return Discovery{}, err
	}
	if err := d.Check(ctx); err != nil {
		return Discovery{}, err
	}
	return d, nil
}

func processAlive(pid int) bool {
	if pid <= 0 {
		return false
	}
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// EnsureOptions say where the server lives and how to start it.
type EnsureOptions struct {
	// Dir is the state directory (required).
	Dir string
	// Binary is the sandboxd-localcloud executable; when empty, the one
	// next to the running executable, else the one on PATH.
	Binary string
	// Args are extra `serve` flags.
	Args   []string
	Logger *slog.Logger
	// Timeout bounds the wait for a started server; 20s when zero.
	Timeout time.Duration
}

// EnsureRunning returns the live server of opts.Dir, starting one detached
// (own session, logging to <dir>/localcloud.log) when there is none. Racing
// callers end up with one server: the loser's child exits on the lock and
// its caller waits for the winner.
func EnsureRunning(ctx context.Context, opts EnsureOptions) (Discovery, error) {
	if opts.Dir == "" {
		return Discovery{}, errors.New("ensure localcloud: no state directory given")
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if d, err := Status(ctx, opts.Dir); err == nil {
		return d, nil
	}
	bin, err := findBinary(opts.Binary)
	if err != nil {
		return Discovery{}, err
	}
	if err := os.MkdirAll(opts.Dir, 0o700); err != nil {
		return Discovery{}, fmt.Errorf("create %s: %w", opts.Dir, err)
	}
	logPath := filepath.Join(opts.Dir, LogFile)
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return Discovery{}, fmt.Errorf("open the localcloud log %s: %w", logPath, err)
	}
	logStart, _ := logf.Seek(0, io.SeekEnd)
	cmd := exec.Command(bin, append([]string{"serve", "--state-dir", opts.Dir}, opts.Args...)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true} // outlives its starter
	if err := cmd.Start(); err != nil {
		logf.Close()
		return Discovery{}, fmt.Errorf("start %s: %w", bin, err)
	}
	logf.Close()
	log.Info("started sandboxd-localcloud", "pid", cmd.Process.Pid, "binary", bin, "log", logPath)
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }() // reaps the child whenever it ends

	timeout := opts.Timeout
	if timeout == 0 {
		timeout = 20 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	lostRace := false
	for {
		if d, err := Status(ctx, opts.Dir); err == nil {
			return d, nil
		}
		select {
		case err := <-exited:
			var ee *exec.ExitError
			if errors.As(err, &ee) && ee.ExitCode() == ExitAlreadyRunning {
				// Another starter won: wait for its discovery file.
				lostRace = true
				exited = nil
				continue
			}
			return Discovery{}, fmt.Errorf("sandboxd-localcloud exited before serving (%v); its log %s ends with:\n%s", err, logPath, logTail(logPath, logStart))
		case <-ctx.Done():
			what := "to serve"
			if lostRace {
				what = "(the running instance) to answer"
			}
			return Discovery{}, fmt.Errorf("timed out waiting for sandboxd-localcloud %s; its log %s ends with:\n%s", what, logPath, logTail(logPath, logStart))
		case <-tick.C:
		}
	}
}

func findBinary(bin string) (string, error) {
	if bin != "" {
		return bin, nil
	}
	if self, err := os.Executable(); err == nil {
		sibling := filepath.Join(filepath.Dir(self), "sandboxd-localcloud")
		if st, err := os.Stat(sibling); err == nil && st.Mode().IsRegular() {
			return sibling, nil
		}
	}
	p, err := exec.LookPath("sandboxd-localcloud")
	if err != nil {
		return "", fmt.Errorf("find sandboxd-localcloud: not next to this program nor on PATH (%w): install it or set its path", err)
	}
	return p, nil
}

// logTail returns the last lines written to path since offset.
func logTail(path string, offset int64) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	if offset > 0 && offset <= int64(len(b)) {
		b = b[offset:]
	}
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > 20 {
		lines = lines[len(lines)-20:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// Stop asks the server of dir to stop (SIGTERM: agents stopped, state
// kept) and waits up to timeout for it to exit.
func Stop(ctx context.Context, dir string, timeout time.Duration) (Discovery, error) {
	d, err := Read(dir)
	if err != nil {
		return Discovery{}, err
	}
	if !processAlive(d.PID) {
		return d, fmt.Errorf("%w (pid %d is gone)", ErrNotRunning, d.PID)
	}
	if err := d.Check(ctx); err != nil {
		// The pid may belong to someone else now: never signal it.
		return d, err
	}
	if err := syscall.Kill(d.PID, syscall.SIGTERM); err != nil {
		return d, fmt.Errorf("signal pid %d: %w", d.PID, err)
	}
	deadline := time.Now().Add(timeout)
	for processAlive(d.PID) {
		if time.Now().After(deadline) {
			return d, fmt.Errorf("sandboxd-localcloud (pid %d) did not stop within %s", d.PID, timeout)
		}
		select {
		case <-ctx.Done():
			return d, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return d, nil
}

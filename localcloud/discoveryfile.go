package localcloud

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/sandboxd/sandboxd/localcloud/discovery"
	"github.com/sandboxd/sandboxd/localcloud/runs"
)

// The discovery file and how clients use it live in package discovery,
// which the daemon links without the server; these names keep the
// server's commands and tests as they were.
type (
	Discovery     = discovery.Discovery
	EnsureOptions = discovery.EnsureOptions
)

// ErrNotRunning means no live server was found.
var ErrNotRunning = discovery.ErrNotRunning

// ExitAlreadyRunning is the exit code of `serve` when another server holds
// the state directory.
const ExitAlreadyRunning = discovery.ExitAlreadyRunning

// ReadDiscovery is discovery.Read.
func ReadDiscovery(dir string) (Discovery, error) { return discovery.Read(dir) }

// Status is discovery.Status.
func Status(ctx context.Context, dir string) (Discovery, error) { return discovery.Status(ctx, dir) }

// EnsureRunning is discovery.EnsureRunning.
func EnsureRunning(ctx context.Context, opts EnsureOptions) (Discovery, error) {
	return discovery.EnsureRunning(ctx, opts)
}

// Stop is discovery.Stop.
func Stop(ctx context.Context, dir string, timeout time.Duration) (Discovery, error) {
	return discovery.Stop(ctx, dir, timeout)
}

func (s *Server) writeDiscovery() error {
	d := Discovery{
		APIURL: s.APIURL(), HTTPURL: s.HTTPURL(), CertFile: s.CertFile(), TokenFile: s.TokenFile(),
		PID: os.Getpid(), Version: s.cfg.Version, StartedAt: s.started, StateDir: s.cfg.Dir,
		Isolation: s.isolationReport(),
		LogFile:   filepath.Join(s.cfg.Dir, LogFile),
	}
	b, err := json.MarshalIndent(d, "", "  ")
	if err != nil {
		return fmt.Errorf("encode the discovery file: %w", err)
	}
	if err := runs.WriteFileAtomic(filepath.Join(s.cfg.Dir, DiscoveryFile), append(b, '\n'), 0o600); err != nil {
		return fmt.Errorf("write the discovery file: %w", err)
	}
	return nil
}

// removeDiscovery deletes the discovery file if it is ours.
func (s *Server) removeDiscovery() {
	path := filepath.Join(s.cfg.Dir, DiscoveryFile)
	if d, err := ReadDiscovery(s.cfg.Dir); err == nil && d.PID == os.Getpid() {
		_ = os.Remove(path)
	}
}

//go:build !linux

package sandbox

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"syscall"
	"time"
)

// Provider starts the sandboxes of one localcloud; off Linux only
// isolation none exists.
type Provider struct{ report Report }

// New accepts only isolation none off Linux.
func New(ctx context.Context, opts Options) (*Provider, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	if opts.Isolation != IsolationNone {
		return nil, fmt.Errorf("%w: sandboxes are isolated with Linux namespaces only (configure isolation %q to run them unisolated)", ErrUnavailable, IsolationNone)
	}
	return &Provider{report: Report{Isolation: IsolationNone, Protections: []string{}, Degraded: []string{"isolation is configured off (isolation: none)"}}}, nil
}

// Report says which protections are active.
func (p *Provider) Report() Report { return p.report }

// RemovedLeftovers is 0: there are no cgroups here.
func (p *Provider) RemovedLeftovers() int { return 0 }

// Sandbox runs plain processes.
type Sandbox struct{ done chan struct{} }

// Start returns a sandbox of plain processes.
func (p *Provider) Start(ctx context.Context, spec Spec) (*Sandbox, error) {
	return &Sandbox{done: make(chan struct{})}, nil
}

// Command returns argv as a plain process in dir.
func (s *Sandbox) Command(ctx context.Context, dir string, argv ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Dir = dir
	return cmd
}

// TerminalCommand returns argv as a plain process in dir, leading a new
// session whose controlling terminal is its stdin.
func (s *Sandbox) TerminalCommand(ctx context.Context, dir string, argv ...string) *exec.Cmd {
	cmd := s.Command(ctx, dir, argv...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	return cmd
}

// DialTCP dials addr.
func (s *Sandbox) DialTCP(ctx context.Context, addr string) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, "tcp", addr)
}

// DevRoot is "": terminals are this machine's.
func (s *Sandbox) DevRoot() string { return "" }

// Done is closed by Close.
func (s *Sandbox) Done() <-chan struct{} { return s.done }

// OOMKilled is always false.
func (s *Sandbox) OOMKilled() bool { return false }

// DiskCheckEvery is DefaultDiskCheckEvery: there is no disk watchdog here.
func (s *Sandbox) DiskCheckEvery() time.Duration { return DefaultDiskCheckEvery }

// OverDiskLimit is never over: the disk limit is Linux's only.
func (s *Sandbox) OverDiskLimit() (used, limit int64, over bool) { return 0, 0, false }

// Close ends the sandbox.
func (s *Sandbox) Close() error {
	select {
	case <-s.done:
	default:
		close(s.done)
	}
	return nil
}

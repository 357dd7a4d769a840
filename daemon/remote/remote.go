// Package remote hands the session manager the configured runs API: the
// embedded local remote (sandboxd-localcloud, found through its discovery
// file or started on demand, its certificate pinned) or RWX Cloud (host and
// access token from the configuration).
package remote

import (
	"context"
	"crypto/x509"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/sandboxd/sandboxd/daemon/runsapi"
	"github.com/sandboxd/sandboxd/daemon/sessions"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/localcloud/discovery"
	"github.com/sandboxd/sandboxd/localcloud/sandbox"
)

// Remote kinds.
const (
	KindLocal = "local"
	KindRWX   = "rwx"
)

// Settings select and locate the remote.
type Settings struct {
	Kind string // KindLocal (default) or KindRWX
	// RWX Cloud.
	Host        string
	Token       string
	TokenSource string // where the token came from, for `nook config`
	// Local remote.
	LocalcloudDir    string
	LocalcloudBinary string
	// APITimeout bounds each runs API call (the client's default when 0).
	APITimeout time.Duration
}

// Provider implements sessions.RemoteSource.
type Provider struct {
	log *slog.Logger

	mu       sync.Mutex
	settings Settings
	client   *runsapi.Client
	pid      int // of the local remote the client talks to
	certFile string
	apiURL   string
	// isolation is the local remote's, from its discovery record.
	isolation *sandbox.Report
}

// New returns a Provider; nothing is contacted or started until first use.
func New(s Settings, log *slog.Logger) *Provider {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if s.Kind == "" {
		s.Kind = KindLocal
	}
	return &Provider{settings: s, log: log}
}

// Update applies new settings (config reload); the next call reconnects if
// they changed.
func (p *Provider) Update(s Settings) {
	if s.Kind == "" {
		s.Kind = KindLocal
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if s != p.settings {
		p.settings, p.client, p.pid, p.certFile, p.apiURL, p.isolation = s, nil, 0, "", "", nil
	}
}

// Info describes the effective remote, never the token.
func (p *Provider) Info() sessions.RemoteInfo {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch p.settings.Kind {
	case KindRWX:
		return sessions.RemoteInfo{Name: KindRWX, Host: p.settings.Host, TokenSource: p.settings.TokenSource, Isolation: "RWX Cloud: each sandbox on its own machine"}
	default:
		info := sessions.RemoteInfo{Name: KindLocal, Host: p.apiURL, CertFile: p.certFile, TokenSource: "localcloud token file"}
		if p.isolation != nil {
			info.Isolation = p.isolation.Summary()
			info.Unisolated = p.isolation.Isolation == sandbox.IsolationNone
		}
		return info
	}
}

// Remote returns the runs API client, starting the local remote if needed.
func (p *Provider) Remote(ctx context.Context) (sessions.Remote, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.client != nil && (p.settings.Kind != KindLocal || processAlive(p.pid)) {
		return p.client, nil
	}
	var err error
	switch p.settings.Kind {
	case KindRWX:
		err = p.connectRWX()
	case KindLocal:
		err = p.connectLocal(ctx)
	default:
		err = errdefs.Invalidf("unknown remote %q in the sandboxd config: use \"local\" or \"rwx\"", p.settings.Kind)
	}
	if err != nil {
		return nil, err
	}
	return p.client, nil
}

func (p *Provider) connectRWX() error {
	if p.settings.Token == "" {
		return errdefs.Invalidf("the remote is RWX Cloud but no access token is configured: set RWX_ACCESS_TOKEN, log in with `rwx login`, or set rwx_access_token in the sandboxd config")
	}
	host := p.settings.Host
	if !strings.Contains(host, "://") {
		host = "https://" + host
	}
	c, err := runsapi.New(runsapi.Options{BaseURL: host, Token: p.settings.Token, Timeout: p.settings.APITimeout, Logger: p.log})
	if err != nil {
		return fmt.Errorf("set up the RWX Cloud client: %w", err)
	}
	p.client = c
	return nil
}

func (p *Provider) connectLocal(ctx context.Context) error {
	d, err := discovery.EnsureRunning(ctx, discovery.EnsureOptions{Dir: p.settings.LocalcloudDir, Binary: p.settings.LocalcloudBinary, Logger: p.log})
	if err != nil {
		return errdefs.Unavailable(fmt.Errorf("start the local remote (sandboxd-localcloud): %w", err))
	}
	token, err := os.ReadFile(d.TokenFile)
	if err != nil {
		return errdefs.Unavailable(fmt.Errorf("read the local remote's token %s: %w", d.TokenFile, err))
	}
	pem, err := os.ReadFile(d.CertFile)
	if err != nil {
		return errdefs.Unavailable(fmt.Errorf("read the local remote's certificate %s: %w", d.CertFile, err))
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return errdefs.Unavailable(fmt.Errorf("the local remote's certificate %s holds no PEM certificate: stop it (sandboxd-localcloud stop) and retry", d.CertFile))
	}
	c, err := runsapi.New(runsapi.Options{BaseURL: d.APIURL, Token: strings.TrimSpace(string(token)), RootCAs: pool, Timeout: p.settings.APITimeout, Logger: p.log})
	if err != nil {
		return fmt.Errorf("set up the local remote client: %w", err)
	}
	p.client, p.pid, p.certFile, p.apiURL, p.isolation = c, d.PID, d.CertFile, d.APIURL, d.Isolation
	p.log.Info("using the local remote", "api", d.APIURL, "pid", d.PID)
	return nil
}

// processAlive tells whether pid still runs (a cheap syscall; the local
// remote restarting on another port makes the cached client stale).
func processAlive(pid int) bool {
	if pid <= 0 {
		return false
	}
	err := syscall.Kill(pid, 0)
	return err == nil || err == syscall.EPERM
}

// CloseIdleConnections closes the runs API client's idle connections (see
// runsapi.Client.CloseIdleConnections), if there is a client.
func (p *Provider) CloseIdleConnections() {
	p.mu.Lock()
	c := p.client
	p.mu.Unlock()
	if c != nil {
		c.CloseIdleConnections()
	}
}

// Package wake notices when this machine's connections may all have gone
// silent without a sign: the machine slept (the wall clock jumped past the
// monotonic one, which stands still in a suspend), the daemon was not
// scheduled for long (stopped, frozen), or the network changed (the
// interface addresses are not the same). The daemon then probes its
// connections at once instead of waiting for their keepalive timeouts.
package wake

import (
	"context"
	"log/slog"
	"net"
	"slices"
	"strings"
	"time"
)

// Defaults of Options.
const (
	DefaultInterval  = time.Second
	DefaultThreshold = 2 * time.Second
)

// Options configure a Watcher; zero values get the defaults.
type Options struct {
	// Interval is how often the clocks and the network are looked at.
	Interval time.Duration
	// Threshold is how far the clocks may drift apart, or a look may come
	// late, before it counts as a wake.
	Threshold time.Duration
	// Wall is the wall clock without its monotonic reading; Mono the
	// monotonic time since some fixed point. Injectable for tests.
	Wall func() time.Time
	Mono func() time.Duration
	// Network fingerprints the network (the interface addresses); nil
	// compares none. An error skips the comparison once.
	Network func() (string, error)
	// OnWake is called with the reason, from the watcher's goroutine; the
	// watcher looks again once it returns.
	OnWake func(reason string)
	Logger *slog.Logger
}

// Watcher compares successive looks at the clocks and the network.
type Watcher struct {
	opts     Options
	wall     time.Time
	mono     time.Duration
	net      string
	haveNet  bool
	haveLook bool
}

// New returns a watcher; its first Check only takes a look.
func New(opts Options) *Watcher {
	if opts.Interval <= 0 {
		opts.Interval = DefaultInterval
	}
	if opts.Threshold <= 0 {
		opts.Threshold = DefaultThreshold
	}
	if opts.Wall == nil {
		opts.Wall = func() time.Time { return time.Now().Round(0) }
	}
	if opts.Mono == nil {
		start := time.Now()
		opts.Mono = func() time.Duration { return time.Since(start) }
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.OnWake == nil {
		opts.OnWake = func(string) {}
	}
	return &Watcher{opts: opts}
}

// Check takes a look and says why the connections may have gone silent
// since the last one, or "" when nothing says so.
func (w *Watcher) Check() string {
	wall, mono := w.opts.Wall(), w.opts.Mono()
	var netPrint string
	netOK := false
	if w.opts.Network != nil {
		var err error
		netPrint, err = w.opts.Network()
		netOK = err == nil
		if err != nil {
			w.opts.Logger.Debug("look at the network", "err", err)
		}
	}
	prevWall, prevMono, prevNet, hadNet, had := w.wall, w.mono, w.net, w.haveNet, w.haveLook
	w.wall, w.mono, w.haveLook = wall, mono, true
	if netOK {
		w.net, w.haveNet = netPrint, true
	}
	if !had {
		return ""
	}
	dWall, dMono := wall.Sub(prevWall), mono-prevMono
	switch {
	case dWall-dMono > w.opts.Threshold:
		return "the machine slept for " + (dWall - dMono).Round(time.Second).String()
	case dMono > w.opts.Interval+w.opts.Threshold:
		return "sandboxd was not running for " + (dMono - w.opts.Interval).Round(time.Second).String()
	case netOK && hadNet && netPrint != prevNet:
		return "the network changed"
	}
	return ""
}

// Run checks every Interval until ctx ends, calling OnWake on a wake.
func (w *Watcher) Run(ctx context.Context) {
	w.Check()
	t := time.NewTicker(w.opts.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if reason := w.Check(); reason != "" {
				w.opts.Logger.Info("connections may have gone silent; probing them now", "reason", reason)
				w.opts.OnWake(reason)
				w.Check() // OnWake's own time is no stop
			}
		}
	}
}

// InterfaceAddrs fingerprints the network by the addresses of the
// interfaces that are up, loopback aside.
func InterfaceAddrs() (string, error) {
	ifs, err := net.Interfaces()
	if err != nil {
		return "", err
	}
	var addrs []string
	for _, i := range ifs {
		if i.Flags&net.FlagUp == 0 || i.Flags&net.FlagLoopback != 0 {
			continue
		}
		as, err := i.Addrs()
		if err != nil {
			return "", err
		}
		for _, a := range as {
			addrs = append(addrs, i.Name+"="+a.String())
		}
	}
	slices.Sort(addrs)
	return strings.Join(addrs, ","), nil
}

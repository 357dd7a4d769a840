// Package reconcile runs the daemon's periodic reconciliation: every
// interval (jittered so that many daemons do not call the remote in step) it
// asks the session manager for a pass; after a failed pass it backs off
// exponentially instead of hammering a remote that is down.
package reconcile

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"sync/atomic"
	"time"
)

// Passer runs one reconcile pass, joining one in flight
// (*sessions.Manager satisfies it through an adapter in the daemon wiring).
type Passer interface {
	Pass(ctx context.Context) error
}

// Clock is the time source of the loop; tests drive it by hand.
type Clock interface {
	After(d time.Duration) <-chan time.Time
}

type realClock struct{}

func (realClock) After(d time.Duration) <-chan time.Time { return time.After(d) }

// Options configure a Loop.
type Options struct {
	Interval   time.Duration // between passes (default 30s)
	Jitter     float64       // fraction of Interval added or removed at random (default 0.2)
	MaxBackoff time.Duration // cap of the backoff after failures (default 5m)
	Clock      Clock
	Rand       func() float64 // in [0,1); default math/rand/v2
	Logger     *slog.Logger
}

// Loop is the periodic reconciler.
type Loop struct {
	p      Passer
	opts   Options
	wakeUp chan struct{}

	interval atomic.Int64 // current Interval, changed by config reloads
}

// New returns a loop; Run starts it.
func New(p Passer, opts Options) *Loop {
	if opts.Interval <= 0 {
		opts.Interval = 30 * time.Second
	}
	if opts.Jitter < 0 || opts.Jitter >= 1 {
		opts.Jitter = 0.2
	}
	if opts.MaxBackoff <= 0 {
		opts.MaxBackoff = 5 * time.Minute
	}
	if opts.Clock == nil {
		opts.Clock = realClock{}
	}
	if opts.Rand == nil {
		opts.Rand = rand.Float64
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	l := &Loop{p: p, opts: opts, wakeUp: make(chan struct{}, 1)}
	l.interval.Store(int64(opts.Interval))
	return l
}

// SetInterval changes the period from the next wait on (config reload);
// zero or negative keeps the current one.
func (l *Loop) SetInterval(d time.Duration) {
	if d > 0 {
		l.interval.Store(int64(d))
	}
}

// Trigger asks for a pass now (coalesced with one already asked for).
func (l *Loop) Trigger() {
	select {
	case l.wakeUp <- struct{}{}:
	default:
	}
}

// Run passes until ctx ends. The first pass runs after one interval: at
// start the daemon's rehydration does the checking.
func (l *Loop) Run(ctx context.Context) {
	failures := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-l.opts.Clock.After(l.next(failures)):
		case <-l.wakeUp:
		}
		if err := l.p.Pass(ctx); err != nil {
			if ctx.Err() != nil {
				return
			}
			failures++
			l.opts.Logger.Warn("reconcile failed; backing off", "err", err, "failures", failures, "next", l.next(failures))
			continue
		}
		failures = 0
	}
}

// next is the wait before the next pass: the jittered interval, doubled for
// each consecutive failure up to MaxBackoff.
func (l *Loop) next(failures int) time.Duration {
	interval := time.Duration(l.interval.Load())
	d := interval
	for i := 0; i < failures && d < l.opts.MaxBackoff; i++ {
		d *= 2
	}
	d = min(d, max(l.opts.MaxBackoff, interval))
	spread := (l.opts.Rand()*2 - 1) * l.opts.Jitter
	return time.Duration(float64(d) * (1 + spread))
}

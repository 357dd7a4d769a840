//go:build linux

package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/localcloud/spawner"
)

// spawnerRetry is how long a sandbox whose spawner could not start runs
// its commands through the entering chain before it tries again.
const spawnerRetry = 30 * time.Second

// spawnerSlot holds a sandbox's spawner: none until the first command,
// started again when it died.
type spawnerSlot struct {
	mu      sync.Mutex
	client  *spawner.Client
	retryAt time.Time // after a failed start: no new try before
	warned  bool
	closed  bool
	// launch starts a spawner (spawner.Launch; tests make it fail).
	launch func(context.Context, *exec.Cmd) (*spawner.Client, error)
}

// Spawn starts argv through the sandbox's spawner, a process inside it
// that forks each command (see package spawner): no cgroup move and no
// entering chain per command. req.Dir "" is the workspace. An error
// wrapping spawner.ErrUnavailable means the command was not started and
// should be run through Command (no isolation, or no spawner could be
// had: that is logged once).
func (s *Sandbox) Spawn(ctx context.Context, req spawner.Request, stdio [3]*os.File) (*spawner.Process, error) {
	if s.holder == nil {
		return nil, fmt.Errorf("%w: the sandbox is not isolated, its commands are plain processes", spawner.ErrUnavailable)
	}
	if req.Dir == "" {
		req.Dir = s.spec.Workspace
	}
	req.Dir = filepath.Clean(req.Dir)
	var err error
	// A spawner that died since the last command is found dead by the
	// request, which it never got: once more with a new one.
	for range 2 {
		var c *spawner.Client
		if c, err = s.spawner.get(ctx, s); err != nil {
			return nil, err
		}
		var p *spawner.Process
		p, err = c.Spawn(ctx, req, stdio)
		if errors.Is(err, spawner.ErrNoAnswer) {
			// Stuck: replaced for the next command. This one is not tried
			// again: it may have started (and died with the spawner).
			s.spawner.drop(c)
			s.log().Warn("the sandbox's spawner did not answer: killed, the next command starts another", "err", err)
		}
		if !errors.Is(err, spawner.ErrUnavailable) {
			return p, err
		}
		s.spawner.drop(c)
	}
	return nil, err
}

// Prewarm starts the sandbox's spawner ahead of its first command (which
// would otherwise wait for it); a failure is logged as in Spawn.
func (s *Sandbox) Prewarm(ctx context.Context) {
	if s.holder != nil {
		_, _ = s.spawner.get(ctx, s)
	}
}

// get returns the running spawner, starting one if there is none (unless
// the last start failed a moment ago).
func (sl *spawnerSlot) get(ctx context.Context, s *Sandbox) (*spawner.Client, error) {
	sl.mu.Lock()
	defer sl.mu.Unlock()
	if sl.closed {
		return nil, fmt.Errorf("%w: the sandbox has ended", spawner.ErrUnavailable)
	}
	if sl.client != nil {
		select {
		case <-sl.client.Done():
			sl.client.Close()
			sl.client = nil
		default:
			return sl.client, nil
		}
	}
	if time.Now().Before(sl.retryAt) {
		return nil, fmt.Errorf("%w: it could not be started a moment ago", spawner.ErrUnavailable)
	}
	select {
	case <-s.done:
		return nil, fmt.Errorf("%w: the sandbox has ended", spawner.ErrUnavailable)
	default:
	}
	// Through the chain every command took before: the spawner gets the
	// namespaces, cgroups (or rlimits), user and dropped capabilities its
	// commands inherit.
	launch := sl.launch
	if launch == nil {
		launch = spawner.Launch
	}
	c, err := launch(ctx, s.Command(context.Background(), s.spec.Workspace, spawner.ExePath))
	if err != nil {
		sl.retryAt = time.Now().Add(spawnerRetry)
		if !sl.warned {
			sl.warned = true
			s.log().Warn("the sandbox's spawner could not be started: its commands take the slower way in (nsenter) until it can",
				"err", err, "retry_in", spawnerRetry)
		}
		return nil, fmt.Errorf("%w: %w", spawner.ErrUnavailable, err)
	}
	sl.client = c
	return c, nil
}

// drop forgets c, found dead (or stuck): the next command starts another.
func (sl *spawnerSlot) drop(c *spawner.Client) {
	sl.mu.Lock()
	if sl.client == c {
		sl.client = nil
	}
	sl.mu.Unlock()
	c.Kill()
}

// close ends the spawner for good.
func (sl *spawnerSlot) close() {
	sl.mu.Lock()
	c := sl.client
	sl.client, sl.closed = nil, true
	sl.mu.Unlock()
	if c != nil {
		c.Close()
	}
}

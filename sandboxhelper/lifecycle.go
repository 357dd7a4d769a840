package sandboxhelper

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// The server's lifecycle without the exec request that started it: the
// daemon starts it as a managed process of the sandbox's agent (RWX's
// `__rwx_sandbox_process_start__`), which outlives the channel. One server
// serves a checkout (lockName), the file currentName says which one, and
// it exits when asked nothing for long, when stopped (TERM, the agent's
// stop directive) or with the run.
const (
	lockName    = "server.lock"
	currentName = "server"
)

// lockServer takes the checkout's server lock, waiting up to lockWait for
// a server being replaced to let it go; ErrServing when another keeps it.
func lockServer(ctx context.Context, dir string) (unlock func(), err error) {
	f, err := os.OpenFile(filepath.Join(dir, lockName), os.O_CREATE|os.O_RDWR|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open the server lock: %w", err)
	}
	deadline := time.Now().Add(lockWait)
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { _ = f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) || time.Now().After(deadline) {
			f.Close()
			if errors.Is(err, syscall.EWOULDBLOCK) {
				return nil, ErrServing
			}
			return nil, fmt.Errorf("lock %s: %w", filepath.Join(dir, lockName), err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// activity tells when the server was last asked something.
type activity struct {
	mu       sync.Mutex
	last     time.Time
	inFlight int
}

func (a *activity) touch() {
	a.mu.Lock()
	a.last = time.Now()
	a.mu.Unlock()
}

func (a *activity) begin() {
	a.mu.Lock()
	a.inFlight++
	a.last = time.Now()
	a.mu.Unlock()
}

func (a *activity) end() {
	a.mu.Lock()
	a.inFlight--
	a.last = time.Now()
	a.mu.Unlock()
}

// exitWhenIdle calls stop once nothing was asked for idle (none when idle
// is not positive).
func (a *activity) exitWhenIdle(ctx context.Context, idle time.Duration, stop func()) {
	if idle <= 0 {
		return
	}
	t := time.NewTicker(min(max(idle/8, 10*time.Millisecond), time.Minute))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		a.mu.Lock()
		quiet := a.inFlight == 0 && time.Since(a.last) >= idle
		a.mu.Unlock()
		if quiet {
			stop()
			return
		}
	}
}

// writeCurrent names the serving instance and the binary it runs (a
// daemon with another binary starts its own server in its place).
func writeCurrent(dir, instance string) error {
	sum, err := selfHash()
	if err != nil {
		return fmt.Errorf("hash the helper binary: %w", err)
	}
	tmp := filepath.Join(dir, "."+currentName+"."+instance)
	if err := os.WriteFile(tmp, []byte(instance+" "+sum+"\n"), 0o644); err != nil {
		return fmt.Errorf("write the server's name: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, currentName)); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("write the server's name: %w", err)
	}
	return nil
}

// removeCurrent removes the name of instance (the lock is still held: no
// other server wrote it since).
func removeCurrent(dir, instance string) {
	if inst, _, err := readCurrent(dir); err == nil && inst == instance {
		_ = os.Remove(filepath.Join(dir, currentName))
	}
}

func readCurrent(dir string) (instance, sum string, err error) {
	f, err := os.Open(filepath.Join(dir, currentName))
	if err != nil {
		return "", "", err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, 256))
	if err != nil {
		return "", "", err
	}
	instance, sum, _ = strings.Cut(strings.TrimSpace(string(b)), " ")
	if !hexName(instance, 64) || !hexName(sum, 64) {
		return "", "", errors.New("the server's name is damaged")
	}
	return instance, sum, nil
}

func hexName(s string, max int) bool {
	if s == "" || len(s) > max {
		return false
	}
	for _, r := range s {
		if !(r >= '0' && r <= '9' || r >= 'a' && r <= 'f') {
			return false
		}
	}
	return true
}

// errNotServing: no server of this binary answers for the checkout.
var errNotServing = errors.New("no server of this helper answers for this checkout")

// Ping returns the instance of the server of this binary that serves the
// checkout of state, waiting up to wait for one to answer.
func Ping(ctx context.Context, state string, wait time.Duration) (string, error) {
	self, err := selfHash()
	if err != nil {
		return "", err
	}
	deadline := time.Now().Add(wait)
	for {
		if inst, sum, err := readCurrent(Dir(state)); err == nil && sum == self {
			actx, cancel := context.WithTimeout(ctx, 5*time.Second)
			_, err := ask(actx, state, inst, "ping", nil)
			cancel()
			if err == nil {
				return inst, nil
			}
		}
		if time.Now().After(deadline) {
			return "", errNotServing
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(25 * time.Millisecond):
		}
	}
}

package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/ipc"
)

// progress shows the phases of a slow wait (the daemon starting, a sandbox
// being created, provisioned and connected) on stderr: one updating line on
// a terminal, plain timestamped lines otherwise, nothing with --quiet. The
// run's URL is always printed on a line of its own, so that it stays.
type progress struct {
	w     io.Writer
	tty   bool
	quiet bool
	now   func() time.Time

	mu      sync.Mutex
	last    string // the last text shown: a phase repeated is not shown again
	onLine  bool   // a terminal line is on screen (to clear)
	frame   int
	stopped chan struct{}
	ticker  *time.Ticker
}

func (a *app) newProgress() *progress {
	return &progress{w: a.sys.Stderr, tty: a.sys.StderrIsTerminal, quiet: a.p.quiet(), now: a.sys.Now}
}

// phaseText is how nook words each phase.
func phaseText(p ipc.Progress) string {
	switch p.Phase {
	case ipc.PhaseDaemonStarting:
		return "starting sandboxd"
	case ipc.PhaseCreating:
		return "creating the sandbox run"
	case ipc.PhaseCreated:
		if p.RunURL == "" {
			return "run created"
		}
		return "run created: " + p.RunURL
	case ipc.PhaseProvisioning:
		if p.Message != "" {
			return "provisioning: " + p.Message
		}
		return "provisioning"
	case ipc.PhaseConnecting:
		return "connecting to the sandbox"
	case ipc.PhaseReady:
		return "sandbox ready"
	case ipc.PhaseWaiting:
		return p.Message
	}
	if p.Phase == "" {
		return p.Message
	}
	if p.Message != "" {
		return p.Phase + ": " + p.Message
	}
	return p.Phase
}

// decodeData decodes an event's data.
func decodeData(data []byte, v any) error { return json.Unmarshal(data, v) }

var spinnerFrames = []string{"⠋", "⠙", "⠹", "⠸", "⠼", "⠴", "⠦", "⠧", "⠇", "⠏"}

// show prints one phase.
func (p *progress) show(ph ipc.Progress) {
	if p == nil || p.quiet {
		return
	}
	text := phaseText(ph)
	p.mu.Lock()
	defer p.mu.Unlock()
	if text == p.last {
		return
	}
	p.last = text
	switch {
	case !p.tty:
		fmt.Fprintf(p.w, "nook: %s %s\n", p.now().Format("15:04:05"), text)
	case ph.Phase == ipc.PhaseCreated:
		fmt.Fprintf(p.w, "\r\033[Knook: %s\n", text) // the URL stays on screen
		p.onLine = false
	default:
		p.draw()
		if p.ticker == nil {
			p.ticker = time.NewTicker(100 * time.Millisecond)
			p.stopped = make(chan struct{})
			go p.animate(p.ticker, p.stopped)
		}
	}
}

func (p *progress) draw() {
	fmt.Fprintf(p.w, "\r\033[K%s %s", spinnerFrames[p.frame%len(spinnerFrames)], p.last)
	p.onLine = true
}

func (p *progress) animate(t *time.Ticker, stop chan struct{}) {
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			p.mu.Lock()
			if p.onLine {
				p.frame++
				p.draw()
			}
			p.mu.Unlock()
		}
	}
}

// done clears the terminal line; the command's own output follows.
func (p *progress) done() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ticker != nil {
		p.ticker.Stop()
		close(p.stopped)
		p.ticker = nil
	}
	if p.onLine {
		fmt.Fprint(p.w, "\r\033[K")
		p.onLine = false
	}
}

// followProgress shows the session.progress events of the sandbox this
// command means (its run, or the repository of the working directory) that
// happen after since (nil: from now on; the replay buffer otherwise) and at
// or after notBefore, until the returned stop is called. It waits until the
// subscription is in place, so that no phase published after it returns
// is missed. Errors are ignored: progress is a courtesy, never a failure.
func (a *app) followProgress(ctx context.Context, pr *progress, since *uint64, notBefore time.Time) (stop func()) {
	if pr == nil || pr.quiet {
		return func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	st, err := a.c.Events(ctx, since)
	if err != nil {
		cancel()
		return func() {}
	}
	runID := a.p.strings["id"]
	root := a.repoRoot()
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer st.Close()
		// Once a sandbox is being created for this command, only its
		// phases show: another start in the same checkout (an earlier
		// command's, another terminal's) is not this command's.
		creating := ""
		for {
			ev, err := st.Next()
			if err != nil {
				return
			}
			if ev.Type != "session.progress" || ev.Time.Before(notBefore) {
				continue
			}
			var ph ipc.Progress
			if decodeData(ev.Data, &ph) != nil {
				continue
			}
			if !((runID != "" && ev.RunID == runID) || (runID == "" && root != "" && ph.RepoRoot == root)) {
				continue
			}
			if creating != "" && ev.SessionID != creating {
				continue
			}
			if ph.Phase == ipc.PhaseCreating && ev.SessionID != "" {
				creating = ev.SessionID
			}
			pr.show(ph)
		}
	}()
	return func() { cancel(); <-done }
}

// repoRoot is the repository of the working directory as the daemon
// resolves it (symlinks resolved, the directory holding .git), or "".
func (a *app) repoRoot() string {
	wd, err := a.sys.Getwd()
	if err != nil {
		return ""
	}
	if real, err := filepath.EvalSymlinks(wd); err == nil {
		wd = real
	}
	for d := wd; ; d = filepath.Dir(d) {
		if _, err := os.Lstat(filepath.Join(d, ".git")); err == nil {
			return d
		}
		if filepath.Dir(d) == d {
			return ""
		}
	}
}

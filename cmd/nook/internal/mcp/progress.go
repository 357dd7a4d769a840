package mcp

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
)

// progressRelay tells an MCP client what an exec waits for, as
// notifications/progress on the call's progress token: the same words nook
// prints on stderr (the queue, the lock, the handshake, the sandbox's start
// phases), so that an agent sees why a call takes long.
type progressRelay struct {
	ss     *sdk.ServerSession
	token  any
	c      *client.Client
	target ipc.Target
	began  time.Time

	mu     sync.Mutex
	n      float64
	last   string
	follow sync.Once
	stop   func()
}

// newProgressRelay is the relay of a call, or nil when the call carries no
// progress token (the client asked for none).
func newProgressRelay(req *sdk.CallToolRequest, c *client.Client, t ipc.Target) *progressRelay {
	if req == nil || req.Session == nil || req.Params == nil {
		return nil
	}
	tok := req.Params.GetProgressToken()
	if tok == nil {
		return nil
	}
	return &progressRelay{ss: req.Session, token: tok, c: c, target: t, began: time.Now()}
}

// notify sends msg unless it repeats the last one.
func (p *progressRelay) notify(ctx context.Context, msg string) {
	if msg == "" {
		return
	}
	p.mu.Lock()
	if msg == p.last {
		p.mu.Unlock()
		return
	}
	p.last = msg
	p.n++
	n := p.n
	p.mu.Unlock()
	// A client that stopped reading must not stall the exec: the
	// notification is bounded and its failure ignored (progress is advice).
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_ = p.ss.NotifyProgress(ctx, &sdk.ProgressNotificationParams{ProgressToken: p.token, Message: msg, Progress: n})
}

// onFrame relays the exec's queued frames as nook shows them.
func (p *progressRelay) onFrame(ctx context.Context) func(ipc.ExecOutput) {
	var queuedSince time.Time
	return func(f ipc.ExecOutput) {
		if f.Type != ipc.ExecQueued {
			return
		}
		switch {
		case ipc.IsWaitOnReady(f.Message):
			p.notify(ctx, f.Message)
		case f.Message != "":
			// The sandbox is being started: its phases follow as
			// session.progress events.
			p.notify(ctx, f.Message)
			p.follow.Do(func() { p.followPhases(ctx) })
		case f.Position > 0:
			if queuedSince.IsZero() {
				queuedSince = time.Now()
			}
			p.notify(ctx, fmt.Sprintf("waiting for the sandbox (%d ahead in its queue) since %s", f.Position, queuedSince.Format("15:04:05")))
		}
	}
}

// followPhases relays the session.progress events of the sandbox this exec
// starts until done is called.
func (p *progressRelay) followPhases(ctx context.Context) {
	ctx, cancel := context.WithCancel(ctx)
	var zero uint64
	st, err := p.c.Events(ctx, &zero)
	if err != nil {
		cancel()
		return
	}
	root, _ := checkoutOf(p.target.Cwd)
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer st.Close()
		creating := ""
		for {
			ev, err := st.Next()
			if err != nil {
				return
			}
			if ev.Type != "session.progress" || ev.Time.Before(p.began) {
				continue
			}
			var ph ipc.Progress
			if json.Unmarshal(ev.Data, &ph) != nil {
				continue
			}
			mine := (p.target.RunID != "" && ev.RunID == p.target.RunID) || (p.target.RunID == "" && root != "" && sameDir(ph.RepoRoot, root))
			if !mine || (creating != "" && ev.SessionID != creating) {
				continue
			}
			if ph.Phase == ipc.PhaseCreating && ev.SessionID != "" {
				creating = ev.SessionID
			}
			p.notify(ctx, phaseMessage(ph))
		}
	}()
	p.mu.Lock()
	p.stop = func() { cancel(); <-done }
	p.mu.Unlock()
}

// followStart relays the start phases of the sandbox a call (other than
// exec, whose frames say when a start begins) names, until done.
func (p *progressRelay) followStart(ctx context.Context) {
	if p != nil {
		p.follow.Do(func() { p.followPhases(ctx) })
	}
}

// done ends the following of phases.
func (p *progressRelay) done() {
	if p == nil {
		return
	}
	p.mu.Lock()
	stop := p.stop
	p.stop = nil
	p.mu.Unlock()
	if stop != nil {
		stop()
	}
}

// phaseMessage is a start phase in words.
func phaseMessage(ph ipc.Progress) string {
	word := map[string]string{
		ipc.PhaseCreating:     "creating the sandbox",
		ipc.PhaseCreated:      "the sandbox's run was created",
		ipc.PhaseProvisioning: "the sandbox is being set up",
		ipc.PhaseConnecting:   "connecting to the sandbox",
		ipc.PhaseReady:        "the sandbox is ready",
		ipc.PhaseWaiting:      "waiting",
	}[ph.Phase]
	switch {
	case word == "":
		word = ph.Phase
	case ph.Message != "" && ph.Phase == ipc.PhaseWaiting:
		return ph.Message
	}
	if ph.Message != "" {
		word += ": " + ph.Message
	}
	if ph.RunURL != "" && ph.Phase == ipc.PhaseCreated {
		word += " (" + ph.RunURL + ")"
	}
	return word
}

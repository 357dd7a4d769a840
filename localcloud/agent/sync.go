package agent

import (
	"fmt"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/crypto/ssh"
)

// markSync applies a sync marker as soon as its exec request is read, before
// the request's reply and before requests on other channels that came after
// it are run: clients send markers without waiting for an answer, so their
// order on the connection is all that places them.
//
// Any other exec request first waits (briefly, see settle) for the requests
// queued before it on the connection's other channels, so a marker sent just
// before it is applied first.
func (a *Agent) markSync(c *connState, q *reqQueue, command string) {
	switch strings.TrimSpace(command) {
	case DirectiveSyncStart, DirectiveSyncEnd:
		c.mu.Lock()
		c.inSync = strings.TrimSpace(command) == DirectiveSyncStart
		c.mu.Unlock()
	default:
		if q != nil {
			q.command.Store(true)
			c.settle(q)
		}
	}
}

// gitServices are git's SSH transport commands the agent serves for the
// workspace's repository, as `git push` / `git fetch` over SSH send them
// (`git-receive-pack '<path>'`).
var gitServices = map[string]string{
	"git-receive-pack":   "receive-pack",
	"git-upload-pack":    "upload-pack",
	"git receive-pack":   "receive-pack",
	"git upload-pack":    "upload-pack",
	"git-upload-archive": "upload-archive",
}

// gitCommand turns a git transport request into the shell command that
// serves it: ok is false when command is not one; err when it names a
// repository outside the workspace. The path is relative to the workspace
// ("." is the checkout) or absolute inside it.
func (a *Agent) gitCommand(command string) (shell string, ok bool, err error) {
	command = strings.TrimSpace(command)
	var sub, arg string
	for name, s := range gitServices {
		if rest, found := strings.CutPrefix(command, name+" "); found {
			sub, arg = s, strings.TrimSpace(rest)
			break
		}
	}
	if sub == "" {
		return "", false, nil
	}
	path, err := unquoteGitPath(arg)
	if err != nil {
		return "", true, err
	}
	ws := filepath.Clean(a.cfg.Workspace)
	dir := path
	if !filepath.IsAbs(dir) {
		dir = filepath.Join(ws, dir)
	}
	dir = filepath.Clean(dir)
	if dir != ws && !strings.HasPrefix(dir, ws+string(filepath.Separator)) {
		return "", true, fmt.Errorf("git %s: %q is outside the sandbox's checkout %s", sub, path, ws)
	}
	return "exec git " + sub + " " + shellQuote(dir), true, nil
}

// unquoteGitPath reads the path argument as git quotes it for a shell
// (sq_quote: 'a'\”b'), or a bare word.
func unquoteGitPath(s string) (string, error) {
	if s == "" {
		return "", fmt.Errorf("no repository path given")
	}
	if !strings.HasPrefix(s, "'") {
		if strings.ContainsAny(s, " \t'\"\\$`;&|<>(){}*?~\n") {
			return "", fmt.Errorf("unsupported repository path %q", s)
		}
		return s, nil
	}
	var b strings.Builder
	for len(s) > 0 {
		if s[0] != '\'' {
			// Between quoted parts only an escaped quote or ! may appear.
			if strings.HasPrefix(s, `\'`) || strings.HasPrefix(s, `\!`) {
				b.WriteByte(s[1])
				s = s[2:]
				continue
			}
			return "", fmt.Errorf("unsupported quoting in %q", s)
		}
		end := strings.IndexByte(s[1:], '\'')
		if end < 0 {
			return "", fmt.Errorf("unterminated quote in %q", s)
		}
		b.WriteString(s[1 : 1+end])
		s = s[2+end:]
	}
	return b.String(), nil
}

func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// reqQueue is one session channel's incoming requests, as the connection's
// ordering sees them.
type reqQueue struct {
	reqs    <-chan *ssh.Request
	handled atomic.Int64
	// idle is true while the session waits for its next request; false
	// from the moment one is taken until it is handled.
	idle atomic.Bool
	// command is set once an exec request that is not a marker was read:
	// nothing queued behind it needs waiting for (two commands arriving
	// together must not wait for each other).
	command atomic.Bool
}

// next takes the session's next request, keeping idle true only while it
// waits.
func (q *reqQueue) next() (*ssh.Request, bool) {
	q.idle.Store(true)
	req, ok := <-q.reqs
	q.idle.Store(false)
	return req, ok
}

// track registers a session's request queue with its connection.
func (c *connState) track(reqs <-chan *ssh.Request) (*reqQueue, func()) {
	q := &reqQueue{reqs: reqs}
	q.idle.Store(true)
	c.mu.Lock()
	if c.queues == nil {
		c.queues = map[*reqQueue]struct{}{}
	}
	c.queues[q] = struct{}{}
	c.mu.Unlock()
	return q, func() {
		c.mu.Lock()
		delete(c.queues, q)
		c.mu.Unlock()
	}
}

// settleWait bounds how long an exec request waits for requests queued
// before it on other channels (a client that pipelines more than markers
// must not stall the agent). Those are handled without blocking (a command
// is started after its reply; commands do not wait for each other), so only
// a starved goroutine takes long: under make test's load a command once ran
// before the marker sent ahead of it, which only a shorter bound allowed.
const settleWait = 2 * time.Second

// settle waits until the requests already queued on the connection's other
// channels are handled. Each channel has its own goroutine, so without this
// a command sent right after a marker (without waiting for the marker's
// answer) could be run, and logged, before the marker is applied. A request
// queued now arrived before self's current one: clients send the next
// command only after the previous one ended, markers excepted.
func (c *connState) settle(self *reqQueue) {
	type pending struct {
		q      *reqQueue
		target int64
	}
	var wait []pending
	c.mu.Lock()
	for q := range c.queues {
		if q == self || q.command.Load() {
			continue
		}
		// A request taken but not yet handled counts as pending too.
		done, n := q.handled.Load(), int64(len(q.reqs))
		if !q.idle.Load() {
			n++
		}
		if n > 0 {
			wait = append(wait, pending{q, done + n})
		}
	}
	c.mu.Unlock()
	if len(wait) == 0 {
		return
	}
	deadline := time.Now().Add(settleWait)
	for _, p := range wait {
		for p.q.handled.Load() < p.target && !p.q.command.Load() && time.Now().Before(deadline) {
			time.Sleep(20 * time.Microsecond)
		}
	}
}

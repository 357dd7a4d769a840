package sandboxhelper

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/internal/watch"
	"github.com/sandboxd/sandboxd/sandboxhelper/hold"
)

// answer is the server's reply to "changes": the paths changed since the
// previous question (see watch.Trees.Changes), or Full when it cannot tell.
type answer struct {
	Instance string   `json:"instance"`
	Full     bool     `json:"full,omitempty"`
	Paths    []string `json:"paths,omitempty"`
	Gone     []string `json:"gone,omitempty"`
	// The native sync's answers: the snapshot and its tree (push);
	// Declined says it does not apply (nothing was changed), Error that it
	// failed.
	Snap     string `json:"snap,omitempty"`
	Tree     string `json:"tree,omitempty"`
	Declined string `json:"declined,omitempty"`
	ForGood  bool   `json:"for_good,omitempty"`
	// Held answers "hold": the command was started (holdKept) or its id
	// was started before (holdStarted).
	Held  string `json:"held,omitempty"`
	Error string `json:"error,omitempty"`
}

// DefaultIdle is how long a server that was asked nothing waits before it
// exits: it outlives the exec request that started it (a managed process
// of the sandbox's agent), so nothing else ends it while the run lasts.
const DefaultIdle = time.Hour

// ErrServing: another server holds the checkout's lock and serves it.
var ErrServing = errors.New("another server serves this checkout")

// lockWait bounds the wait for the lock of a server being replaced (the
// agent stops the previous process of the same name first, which may take
// its grace period).
var lockWait = 10 * time.Second

// Serve tracks the working tree at root (absolute) and answers questions on
// a socket in the helper directory of state (the sync state directory,
// .git/sandboxd) until ctx ends or it was asked nothing for DefaultIdle.
// Once it answers, it writes Ready and its instance to ready.
func Serve(ctx context.Context, root, state string, ready io.Writer, log *slog.Logger) error {
	return ServeIdle(ctx, root, state, DefaultIdle, ready, log)
}

// ServeIdle is Serve, exiting once asked nothing for idle. One server runs
// per checkout: it holds the lock file of the helper directory, and names
// its instance in the file Current names, where Ping finds it.
func ServeIdle(ctx context.Context, root, state string, idle time.Duration, ready io.Writer, log *slog.Logger) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	dir := Dir(state)
	cookies := filepath.Join(dir, "cookies")
	if err := os.MkdirAll(cookies, 0o755); err != nil {
		return fmt.Errorf("create the helper directory: %w", err)
	}
	unlock, err := lockServer(ctx, dir)
	if err != nil {
		return err
	}
	defer unlock()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	act := &activity{}
	act.touch()
	go act.exitWhenIdle(ctx, idle, cancel)
	removeStaleSockets(dir)
	swept := make(chan struct{})
	go func() {
		defer close(swept)
		sweepHeld(log)
	}()
	defer func() { <-swept }()
	// The tracker is the only one of this process: one tree, kept however
	// long the sandbox stays idle.
	trees := watch.NewTrees(watch.TreesOptions{Logger: log, MaxTrees: 1, Idle: 365 * 24 * time.Hour, MaxDirty: maxTracked})
	defer trees.Close()
	// The first question places the watches (it answers full).
	trees.Changes(ctx, root, cookies)

	instance := newInstance()
	addr, release, err := sockAddr(dir, socketName(instance))
	if err != nil {
		return err
	}
	defer release()
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: addr, Net: "unix"})
	if err != nil {
		return fmt.Errorf("listen on the helper socket: %w", err)
	}
	ln.SetUnlinkOnClose(true)
	stop := context.AfterFunc(ctx, func() { _ = ln.Close() })
	defer stop()
	defer ln.Close()
	if err := writeCurrent(dir, instance); err != nil {
		return err
	}
	defer removeCurrent(dir, instance)
	if _, err := fmt.Fprintf(ready, "%s%s\n", Ready, instance); err != nil {
		return err
	}
	// One question at a time: each answer starts the next one's "since",
	// and the native sync's base goes with it.
	var mu sync.Mutex
	nat := &nativeState{root: root, gitDir: filepath.Dir(state), state: state,
		changes: func(ctx context.Context) ([]string, []string, bool) { return trees.Changes(ctx, root, cookies) }}
	defer nat.close()
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := ln.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("accept on the helper socket: %w", err)
		}
		act.begin()
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer act.end()
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(time.Minute))
			a, follow := serveOne(ctx, c, &mu, nat, act)
			a.Instance = instance
			if err := json.NewEncoder(c).Encode(a); err != nil || follow == nil {
				return
			}
			// A streamed hold: the connection lasts as long as the
			// command, or the start that asked, or this server.
			_ = c.SetDeadline(time.Time{})
			stop := context.AfterFunc(ctx, func() { _ = c.Close() })
			defer stop()
			follow(c)
		}()
	}
}

// maxRequest bounds a question's body (a native push carries the files
// it writes; the daemon sends at most the fused patch's limit of them).
const maxRequest = 16 << 20

// serveOne answers one question: a line naming it, then its JSON body.
// follow, when not nil, goes on with the connection once it is answered.
func serveOne(ctx context.Context, c *net.UnixConn, mu *sync.Mutex, nat *nativeState, act *activity) (a answer, follow func(*net.UnixConn)) {
	br := bufio.NewReader(io.LimitReader(c, maxRequest))
	line, err := br.ReadString('\n')
	if err != nil || len(line) > 256 {
		return answer{Error: "unknown question"}, nil
	}
	verb, arg, _ := strings.Cut(strings.TrimSpace(line), " ")
	if verb == "ping" {
		return answer{}, nil // Ping: the instance is the answer
	}
	if verb == "hold" || verb == "hold-stream" {
		// Needs no lock: it touches only the exec's own directory.
		var req hold.SpawnRequest
		dec := json.NewDecoder(br)
		if err := dec.Decode(&req); err != nil {
			return answer{Error: "read the hold: " + err.Error()}, nil
		}
		if verb == "hold" {
			return serveHold(arg, req, act, nil), nil
		}
		st := hold.NewStream()
		a := serveHold(arg, req, act, st)
		if a.Held != holdKept {
			return a, nil
		}
		// The start sends its frames once answered: what the decoder
		// read ahead is theirs. The stream's frames are bounded by
		// their own reader, not by a request's bound.
		rest := io.MultiReader(dec.Buffered(), br, c)
		return a, func(c *net.UnixConn) { st.Serve(ctx, c, rest) }
	}
	return serveLocked(ctx, verb, arg, br, mu, nat), nil
}

// serveLocked answers the questions that take the server's lock (the
// tracker's and the native sync's), one at a time.
func serveLocked(ctx context.Context, verb, arg string, br *bufio.Reader, mu *sync.Mutex, nat *nativeState) answer {
	// The body is read before the lock: a slow client holds up no one.
	var push pushRequest
	var pull pullRequest
	switch verb {
	case "push":
		if err := json.NewDecoder(br).Decode(&push); err != nil {
			return answer{Error: "read the push: " + err.Error()}
		}
	case "pull":
		if err := json.NewDecoder(br).Decode(&pull); err != nil {
			return answer{Error: "read the pull: " + err.Error()}
		}
	}
	mu.Lock()
	defer mu.Unlock()
	switch verb {
	case "changes":
		// A plain stage moves the tracker's "since" past what the
		// native sync knows.
		nat.forget()
		var a answer
		a.Paths, a.Gone, a.Full = nat.changes(ctx)
		return a
	case "adopt":
		if err := nat.adopt(arg); err != nil {
			return answer{Error: err.Error()}
		}
		return answer{}
	case "push":
		snap, tree, err := nat.push(ctx, push)
		return nativeAnswer(answer{Snap: snap, Tree: tree}, err)
	case "pull":
		return nativeAnswer(answer{}, nat.pull(ctx, pull))
	}
	return answer{Error: "unknown question"}
}

// nativeAnswer is the answer to a native push or pull that ended with err.
func nativeAnswer(a answer, err error) answer {
	switch {
	case errors.Is(err, errDecline):
		return answer{Declined: err.Error(), ForGood: errors.Is(err, errForGood)}
	case err != nil:
		return answer{Error: err.Error()}
	}
	return a
}

// removeStaleSockets removes the sockets of servers no longer running (a
// killed server leaves its socket file behind); a live one, of another
// connection, answers and is kept.
func removeStaleSockets(dir string) {
	names, _ := filepath.Glob(filepath.Join(dir, "*.sock"))
	for _, n := range names {
		addr, release, err := sockAddr(dir, filepath.Base(n))
		if err != nil {
			continue
		}
		c, err := net.DialTimeout("unix", addr, time.Second)
		release()
		if err == nil {
			c.Close()
			continue
		}
		if errors.Is(err, os.ErrNotExist) || strings.Contains(err.Error(), "connection refused") {
			_ = os.Remove(n)
		}
	}
}

// query asks the server instance in the helper directory of state which
// paths changed since its previous answer.
func query(ctx context.Context, state, instance string) (answer, error) {
	return ask(ctx, state, instance, "changes", nil)
}

// ask sends the question line and, when body is not nil, its JSON body.
// askTimeout bounds a question to the server when the caller set no
// deadline: a native push or pull of a large tree takes seconds.
const askTimeout = 10 * time.Minute

func ask(ctx context.Context, state, instance, line string, body any) (answer, error) {
	var a answer
	if instance == "" || strings.ContainsAny(instance, "/.") {
		return a, fmt.Errorf("%w: no helper instance", errNotAsked)
	}
	addr, release, err := sockAddr(Dir(state), socketName(instance))
	if err != nil {
		return a, fmt.Errorf("%w: %w", errNotAsked, err)
	}
	defer release()
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", addr)
	if err != nil {
		return a, fmt.Errorf("%w: %w", errNotAsked, err)
	}
	defer c.Close()
	// A server that never answers must not hold the exchange forever.
	dl, ok := ctx.Deadline()
	if !ok {
		dl = time.Now().Add(askTimeout)
	}
	_ = c.SetDeadline(dl)
	req := []byte(line + "\n")
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return a, err
		}
		req = append(req, b...)
	}
	if _, err := c.Write(req); err != nil {
		// Cut short: the server does not act on a partial question.
		return a, fmt.Errorf("%w: %w", errNotAsked, err)
	}
	if err := json.NewDecoder(io.LimitReader(c, 64<<20)).Decode(&a); err != nil {
		return a, fmt.Errorf("read the helper's answer: %w", err)
	}
	if a.Instance != instance {
		// Not this instance's server: it never had the question.
		return a, fmt.Errorf("%w: the helper answered as %q, not %q", errNotAsked, a.Instance, instance)
	}
	if a.Error != "" {
		return a, fmt.Errorf("%w: %s", errAnsweredError, a.Error)
	}
	return a, nil
}

// errNotAsked: the question never reached this instance's server;
// errAnsweredError: the server answered an error, which it does only
// before acting on the question.
var (
	errNotAsked      = errors.New("the helper's server was not asked")
	errAnsweredError = errors.New("the helper's server answered an error")
)

// maxSockPath is what a socket address holds (108 bytes with the NUL).
const maxSockPath = 107

// sockAddr is the address of socket name in dir: its path, or, when that
// is longer than a socket address holds (checkouts sit deep), the path
// through /proc/self/fd of dir opened for the time of the call (release
// closes it).
func sockAddr(dir, name string) (addr string, release func(), err error) {
	p := filepath.Join(dir, name)
	if len(p) <= maxSockPath {
		return p, func() {}, nil
	}
	f, err := os.Open(dir)
	if err != nil {
		return "", nil, fmt.Errorf("open the helper directory: %w", err)
	}
	return fmt.Sprintf("/proc/self/fd/%d/%s", f.Fd(), name), func() { _ = f.Close() }, nil
}

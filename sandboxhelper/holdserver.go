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
	"path/filepath"
	"strings"
	"time"

	"github.com/sandboxd/sandboxd/sandboxhelper/hold"
)

// Answers of "hold" (answer.Held).
const (
	holdKept    = "kept"
	holdStarted = "started"
)

// Bounds of a hold request.
const (
	maxHoldArgs = 1 << 14
	maxHoldEnv  = 1 << 14
)

// holdAsk bounds the question of `hold start` to the server: past it the
// start falls back to a keeper of its own.
var holdAsk = 5 * time.Second

// serveHold runs and keeps the command of exec id (hold.Holder.Spawn):
// the server outlives the channel as the keeper would, without one more
// process start per exec. The server idles not while a command runs.
// With st, the command is streamed to the start (st.Serve) too.
func serveHold(id string, req hold.SpawnRequest, act *activity, st *hold.Stream) answer {
	if err := checkHold(req); err != nil {
		return answer{Error: err.Error()}
	}
	act.begin()
	done, err := (&hold.Holder{Root: req.Root}).SpawnStream(id, req.Argv, req.Env, req.Dir, st)
	if err != nil {
		act.end()
		if errors.Is(err, hold.ErrStarted) {
			return answer{Held: holdStarted}
		}
		return answer{Error: err.Error()}
	}
	go func() {
		<-done
		act.end()
	}()
	return answer{Held: holdKept}
}

func checkHold(req hold.SpawnRequest) error {
	switch {
	case len(req.Argv) == 0 || len(req.Argv) > maxHoldArgs:
		return fmt.Errorf("a held command has 1 to %d arguments", maxHoldArgs)
	case len(req.Env) > maxHoldEnv:
		return fmt.Errorf("a held command has at most %d environment variables", maxHoldEnv)
	case !filepath.IsAbs(req.Root) || filepath.Clean(req.Root) != req.Root:
		return errors.New("the holder's directory is not a clean absolute path")
	case !filepath.IsAbs(req.Dir):
		return errors.New("the held command's directory is not absolute")
	}
	for _, kv := range req.Env {
		if !strings.Contains(kv, "=") || strings.ContainsRune(kv, 0) {
			return errors.New("a held command's environment variable is malformed")
		}
	}
	return nil
}

// askHold asks the server that serves the checkout of the helper binary
// self (STATE/bin/NAME) to keep the command of id; nil when it did.
func askHold(ctx context.Context, self, id string, req hold.SpawnRequest) error {
	bin := filepath.Dir(self)
	if filepath.Base(bin) != "bin" {
		return errors.New("the helper is not in a state directory's bin")
	}
	state := filepath.Dir(bin)
	inst, _, err := readCurrent(Dir(state))
	if err != nil {
		return fmt.Errorf("%w: no server serves this checkout: %w", hold.ErrRefused, err)
	}
	ctx, cancel := context.WithTimeout(ctx, holdAsk)
	defer cancel()
	a, err := ask(ctx, state, inst, "hold "+id, req)
	if err != nil {
		return refused(err)
	}
	switch a.Held {
	case holdKept:
		return nil
	case holdStarted:
		return hold.ErrStarted
	}
	// A server answers kept or started: this is another process.
	return fmt.Errorf("%w: the server answered %q to a hold", hold.ErrRefused, a.Held)
}

// refused is err of a question to the server, wrapping hold.ErrRefused
// when the server was not asked or answered an error (before acting on
// the question); a lost answer may follow a command that started.
func refused(err error) error {
	if errors.Is(err, errNotAsked) || errors.Is(err, errAnsweredError) {
		return fmt.Errorf("%w: %w", hold.ErrRefused, err)
	}
	return err
}

// askHoldStream is askHold for a streamed start: on "kept" it returns the
// connection, on which the server streams the command (hold.Stream), and
// its reading side past the answer.
func askHoldStream(ctx context.Context, self, id string, req hold.SpawnRequest) (io.WriteCloser, io.Reader, error) {
	bin := filepath.Dir(self)
	if filepath.Base(bin) != "bin" {
		return nil, nil, errors.New("the helper is not in a state directory's bin")
	}
	state := filepath.Dir(bin)
	inst, _, err := readCurrent(Dir(state))
	if err != nil {
		return nil, nil, fmt.Errorf("%w: no server serves this checkout: %w", hold.ErrRefused, err)
	}
	if strings.ContainsAny(inst, "/.") {
		return nil, nil, fmt.Errorf("%w: no helper instance", hold.ErrRefused)
	}
	addr, release, err := sockAddr(Dir(state), socketName(inst))
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %w", hold.ErrRefused, err)
	}
	defer release()
	ctx, cancel := context.WithTimeout(ctx, holdAsk)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", addr)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %w", hold.ErrRefused, err)
	}
	ok := false
	defer func() {
		if !ok {
			c.Close()
		}
	}()
	dl, _ := ctx.Deadline()
	_ = c.SetDeadline(dl)
	body, err := json.Marshal(req)
	if err != nil {
		return nil, nil, err
	}
	if _, err := c.Write(append([]byte("hold-stream "+id+"\n"), body...)); err != nil {
		// Cut short: the server does not act on a partial question.
		return nil, nil, fmt.Errorf("%w: %w", hold.ErrRefused, err)
	}
	// The answer is one line; what follows it is the stream's.
	br := bufio.NewReaderSize(c, 4<<10)
	line, err := br.ReadSlice('\n')
	if err != nil {
		return nil, nil, fmt.Errorf("read the helper's answer: %w", err)
	}
	var a answer
	if err := json.Unmarshal(line, &a); err != nil {
		return nil, nil, fmt.Errorf("read the helper's answer: %w", err)
	}
	switch {
	case a.Instance != inst:
		return nil, nil, fmt.Errorf("%w: the helper answered as %q, not %q", hold.ErrRefused, a.Instance, inst)
	case a.Error != "":
		return nil, nil, fmt.Errorf("%w: %s", hold.ErrRefused, a.Error)
	case a.Held == holdStarted:
		return nil, nil, hold.ErrStarted
	case a.Held != holdKept:
		return nil, nil, fmt.Errorf("%w: the server answered %q to a hold", hold.ErrRefused, a.Held)
	}
	_ = c.SetDeadline(time.Time{})
	ok = true
	return c, br, nil
}

// heldSweepAge is how long an ended exec's files stay in the holder when
// no daemon named it to forget (one that restarted, or never came back).
const heldSweepAge = 24 * time.Hour

// sweepHeld removes what the holder keeps of execs that ended more than
// heldSweepAge ago; a server runs it when it starts.
func sweepHeld(log *slog.Logger) {
	root, err := hold.DefaultRoot()
	if err != nil {
		return
	}
	if n, err := (&hold.Holder{Root: root}).Sweep(heldSweepAge, time.Now()); n > 0 || err != nil {
		log.Info("swept the files of execs that ended long ago", "removed", n, "err", err)
	}
}

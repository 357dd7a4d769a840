package hold

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// The relay: one long-lived channel per kept connection (`hold relay`)
// that does for each held exec in turn what `hold start` does, so that a
// held exec starts no process of its own. A sandbox's execs run one at a
// time, so the relay serves one at a time and needs no multiplexer.
//
// Frames, both ways, are the stream's (a type byte, a 4-byte big-endian
// length, the payload). The relay first says it serves ('y'). The daemon
// sends a request, then the exec's stdin ('i', 'z'); the relay answers
// the command's output ('o', 'e') and its end ('x'), which names the
// exec. An exchange request runs a synced exec's exchange in this process
// (Options.Exchange) instead: 'i' carries the daemon's exchange frames,
// 'o' the exchange's, 'e' its messages. Stdin frames that come while no exec
// runs are an earlier exec's and are dropped. Signals and the caller's
// end travel as `hold signal` execs, not on this channel, where they
// could wait behind stdin the command does not read.
const (
	FrameRequest = helperproto.HoldRequest
	FrameReady   = helperproto.HoldReady
	FrameOut     = frameOut
	FrameErr     = frameErr
	FrameEnd     = frameEnd
	FrameIn      = frameIn
	FrameInEnd   = frameInEnd
)

// Bounds of the relay's frames: a data frame, an end, a request.
const (
	MaxRelayFrame   = maxStreamFrame
	MaxRelayEnd     = maxEndFrame
	MaxRelayRequest = helperproto.MaxHoldRequest
)

// RelayRequest and RelayEnd are the wire's (internal/helperproto).
type (
	RelayRequest = helperproto.RelayRequest
	RelayEnd     = helperproto.RelayEnd
)

// relayWriter writes whole frames to the channel, one at a time.
type relayWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (w *relayWriter) frame(typ byte, p []byte) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	_, err := w.w.Write(appendFrame(nil, typ, p))
	return err
}

// relayStream is one of the command's streams, in frames of typ.
type relayStream struct {
	w   *relayWriter
	typ byte
}

func (s relayStream) Write(p []byte) (int, error) {
	for b := p; len(b) > 0; {
		k := min(len(b), maxStreamFrame)
		if err := s.w.frame(s.typ, b[:k]); err != nil {
			return len(p) - len(b), err
		}
		b = b[k:]
	}
	return len(p), nil
}

// relayExec is the exec the relay serves now.
type relayExec struct {
	cancel context.CancelFunc
	// stdin takes hold's stdin frames (FeedFrames) for startHeld, or with
	// raw the daemon's exchange frames as they came.
	stdin *io.PipeWriter
	raw   bool
}

// Relay serves held execs read from in, one at a time, writing their
// frames to out, until in ends (nil), ctx ends, or the daemon breaks the
// protocol. env and wd are the relay's own environment and working
// directory, which a request's are added to. An exec under way when the
// relay ends goes on in the sandbox: the daemon attaches to it.
func (o Options) Relay(ctx context.Context, h *Holder, in io.Reader, out io.Writer, env []string, wd string) error {
	w := &relayWriter{w: out}
	var (
		mu  sync.Mutex
		cur *relayExec
		wg  sync.WaitGroup
	)
	defer func() {
		mu.Lock()
		if cur != nil {
			cur.cancel()
			cur.stdin.Close()
		}
		mu.Unlock()
		wg.Wait()
	}()
	// The daemon hands a synced exec's exchange only to a relay that said
	// it serves: a helper that is not one never takes its frames.
	if err := w.frame(FrameReady, nil); err != nil {
		return fmt.Errorf("say the relay serves: %w", err)
	}
	buf := make([]byte, maxStreamFrame)
	for {
		typ, p, err := readFrame(in, buf, MaxRelayRequest)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read the daemon's frame: %w", err)
		}
		mu.Lock()
		e := cur
		mu.Unlock()
		switch typ {
		case FrameIn, FrameInEnd:
			if e == nil || len(p) > maxStreamFrame {
				continue // an earlier exec's
			}
			if e.raw {
				if typ == FrameInEnd {
					e.stdin.Close()
				} else {
					// Blocks while the exchange does not read (its command
					// does not read its stdin).
					_, _ = e.stdin.Write(p)
				}
				continue
			}
			var hdr [4]byte
			binary.BigEndian.PutUint32(hdr[:], uint32(len(p)))
			// Blocks while the command does not read its stdin; the
			// exec's end closes the pipe.
			if _, err := e.stdin.Write(append(hdr[:], p...)); err == nil && typ == FrameInEnd {
				e.stdin.Close()
			}
		case FrameRequest:
			if e != nil {
				return errors.New("a request came while an exec ran")
			}
			var req RelayRequest
			if err := json.Unmarshal(p, &req); err != nil {
				return fmt.Errorf("the request is unreadable: %w", err)
			}
			if err := checkRelayRequest(req); err != nil {
				return err
			}
			ectx, cancel := context.WithCancel(ctx)
			pr, pw := io.Pipe()
			e = &relayExec{cancel: cancel, stdin: pw, raw: req.Exchange}
			mu.Lock()
			cur = e
			mu.Unlock()
			dir := wd
			if req.Dir != "" {
				dir = req.Dir
			}
			cenv := append(append([]string(nil), env...), req.Env...)
			if len(req.Forget) > 0 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for _, id := range req.Forget {
						_ = h.Forget(id)
					}
				}()
			}
			end := func(code int) {
				b, _ := json.Marshal(RelayEnd{ID: req.ID, ExitCode: code})
				// Idle before the end goes out: the daemon's next request
				// may follow it at once.
				mu.Lock()
				cur = nil
				mu.Unlock()
				_ = w.frame(FrameEnd, b)
			}
			if req.Exchange {
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer cancel()
					code := ExitFailed
					if o.Exchange != nil {
						code = o.Exchange(ectx, req, wd, env, pr, relayStream{w, FrameOut}, relayStream{w, FrameErr})
					} else {
						fmt.Fprintln(relayStream{w, FrameErr}, "hold relay: this helper runs no exchange")
					}
					pr.CloseWithError(errors.New("the exchange ended"))
					end(code)
				}()
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer cancel()
				stderr := relayStream{w, FrameErr}
				code, err := o.startHeld(ectx, h, req.ID, req.Argv, cenv, dir, pr, true, nil, relayStream{w, FrameOut}, stderr)
				pr.CloseWithError(errors.New("the exec ended"))
				switch {
				case errors.Is(err, ErrStarted):
					fmt.Fprintf(stderr, "hold start: %v\n", err)
					code = ExitStarted
				case err != nil && ectx.Err() != nil:
					return // the relay ends: the daemon attaches
				case err != nil:
					fmt.Fprintf(stderr, "hold start: %v\n", err)
					code = ExitFailed
				}
				end(code)
			}()
		default:
			return fmt.Errorf("a frame of unknown type %q", typ)
		}
	}
}

func checkRelayRequest(req RelayRequest) error {
	switch {
	case !validID(req.ID):
		return fmt.Errorf("exec id %q is not 16 to 64 lowercase hex digits", req.ID)
	case req.Exchange && (len(req.Argv) > 0 || req.Dir != "" || len(req.Env) > 0):
		return errors.New("an exchange request names a command")
	case !req.Exchange && len(req.Argv) == 0:
		return errors.New("the request has no command")
	case req.Dir != "" && !filepath.IsAbs(req.Dir):
		return errors.New("the request's directory is not absolute")
	case len(req.Forget) > helperproto.MaxForget:
		return fmt.Errorf("the request names %d execs to forget, more than %d", len(req.Forget), helperproto.MaxForget)
	case slices.ContainsFunc(req.Forget, func(id string) bool { return !validID(id) || id == req.ID }):
		return errors.New("the request names an exec to forget that is malformed or its own")
	}
	for _, kv := range req.Env {
		if !strings.Contains(kv, "=") || strings.ContainsRune(kv, 0) {
			return errors.New("a request's environment variable is malformed")
		}
	}
	return nil
}

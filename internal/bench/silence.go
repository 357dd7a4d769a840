package bench

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
)

// silenceFigures are the silence rows' figures: the (8 s of
// silence, a 20-line 20-second command), shorter in quick mode.
func (r *runner) silenceFigures() (silence time.Duration, lines int, every time.Duration) {
	if r.opts.Quick {
		return 2 * time.Second, 6, 500 * time.Millisecond
	}
	return 8 * time.Second, 20, time.Second
}

// silenceRows: how long the first exec takes once a silence that lost the
// connection holding the sandbox's lock is over (the connection is
// replaced, the agent frees the lock at its keepalive timeout), and
// whether a command across a silence that holds its bytes keeps all its
// output and its exit status. localcloud's and sandboxd's defaults apply.
//
// They take half a minute or more each: they run at the last round-trip
// time only (20 ms in make bench).
func (r *runner) silenceRows(ctx context.Context, repo string) error {
	if n := len(r.opts.RTTs); n > 0 && r.rtt != r.opts.RTTs[n-1] {
		return nil
	}
	silence, lines, every := r.silenceFigures()
	if _, err := r.libExec(ctx, repo, true, "true"); err != nil {
		return err
	}
	if err := r.silence(ctx, silence, true); err != nil {
		return err
	}
	if err := sleepCtx(ctx, silence); err != nil {
		return err
	}
	start := time.Now()
	_, err := r.libExec(ctx, repo, true, "true")
	took := time.Since(start)
	row := Row{Scenario: fmt.Sprintf("first exec after %s of silence", silence), N: 1, MedianMs: ms(took), P95Ms: ms(took), ExecsPerCall: -1, ChansPerCall: -1, APIPerCall: -1,
		Note: "the connection that held the lock went silent for good during the lease"}
	if err != nil {
		row.Note = "failed: " + err.Error()
	}
	r.add(row)

	script := fmt.Sprintf("i=1; while [ $i -le %d ]; do echo line $i; i=$((i+1)); sleep %s; done; exit 7", lines, fmt.Sprint(every.Seconds()))
	var out bytes.Buffer
	type outcome struct {
		res ipc.ExecResult
		err error
	}
	done := make(chan outcome, 1)
	start = time.Now()
	go func() {
		res, err := r.e.client.Exec(ctx, ipc.ExecRequest{Target: ipc.Target{Cwd: repo}, Argv: []string{"sh", "-c", script}, NoSync: true}, client.ExecOptions{Stdout: &out})
		done <- outcome{res, err}
	}()
	if err := sleepCtx(ctx, time.Duration(lines)*every/4); err != nil {
		return err
	}
	if err := r.silence(ctx, silence, false); err != nil {
		return err
	}
	o := <-done
	took = time.Since(start)
	row = Row{Scenario: fmt.Sprintf("a %s command across %s of silence", time.Duration(lines)*every, silence), N: 1, MedianMs: ms(took), P95Ms: ms(took), ExecsPerCall: -1, ChansPerCall: -1, APIPerCall: -1}
	got := strings.Count(out.String(), "line ")
	switch {
	case o.err != nil:
		row.Note = fmt.Sprintf("failed after %d of %d lines: %v", got, lines, o.err)
	default:
		row.Note = fmt.Sprintf("%d of %d lines, exit %d (the command's: 7)", got, lines, o.res.ExitCode)
	}
	r.add(row)
	return nil
}

// silence makes localcloud's open connections go silent for d (held, or
// lost for good with drop). Only the connection that asks is spared: the
// bench's other idle ones are closed first.
func (r *runner) silence(ctx context.Context, d time.Duration, drop bool) error {
	r.e.lcHTTP.CloseIdleConnections()
	return r.e.lcCall(ctx, http.MethodPost, "/admin/silence", map[string]any{"duration_ms": d.Milliseconds(), "drop": drop}, nil)
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

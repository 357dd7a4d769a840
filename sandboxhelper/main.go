package sandboxhelper

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/sandboxd/sandboxd/internal/helperproto"
	"github.com/sandboxd/sandboxd/sandboxhelper/hold"
)

// Exit codes of the verbs: their own status, nothing else.
const (
	exitFailed = 1
	exitUsage  = 2
)

// ExitNotServing: ping found no server of this binary for the checkout.
const ExitNotServing = helperproto.ExitNotServing

// Main is the program: `serve -state DIR [-idle D]`, `ping -state DIR
// [-wait D]`, `exchange -state DIR -path PATH`, `hold ...` or `version`,
// run in the checkout's root.
func Main(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprintln(stderr, "usage: sandboxd-helper serve|ping|exchange|hold|version [flags]")
		return exitUsage
	}
	if args[0] == "hold" {
		// Durable execs (docs/durable-exec.md).
		if len(args) > 1 && args[1] == "relay" {
			// Before it reads a frame: a command of the same uid must
			// not ptrace the relay to forge what the daemon takes as the
			// end of its execs.
			undumpable()
		}
		self, err := os.Executable()
		if err != nil {
			fmt.Fprintf(stderr, "%s: %v\n", Name, err)
			return exitFailed
		}
		o := hold.Options{Self: self, Server: func(ctx context.Context, id string, req hold.SpawnRequest) error {
			return askHold(ctx, self, id, req)
		}, Stream: func(ctx context.Context, id string, req hold.SpawnRequest) (io.WriteCloser, io.Reader, error) {
			return askHoldStream(ctx, self, id, req)
		}, Exchange: relayExchange}
		return hold.MainWith(ctx, o, args[1:], stdin, stdout, stderr)
	}
	fs := flag.NewFlagSet(Name+" "+args[0], flag.ContinueOnError)
	fs.SetOutput(stderr)
	state := fs.String("state", "", "the sync state directory (.git/sandboxd), absolute")
	path := fs.String("path", "", "exchange: the command's PATH")
	idle := fs.Duration("idle", DefaultIdle, "serve: exit after this long without a question")
	wait := fs.Duration("wait", 0, "ping: wait this long for a server to answer")
	if err := fs.Parse(args[1:]); err != nil {
		return exitUsage
	}
	root, err := os.Getwd()
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", Name, err)
		return exitFailed
	}
	switch args[0] {
	case "version":
		sum, err := selfHash()
		if err != nil {
			fmt.Fprintf(stderr, "%s: %v\n", Name, err)
			return exitFailed
		}
		fmt.Fprintf(stdout, "%s %s\n", Name, sum)
		return 0
	case "serve":
		if *state == "" {
			fmt.Fprintln(stderr, "serve: -state is required")
			return exitUsage
		}
		// No tie to the exec request that started it (stdin, the
		// channel): a managed process of the agent, it ends with TERM,
		// the run, or after -idle without a question.
		log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
		err := ServeIdle(ctx, root, *state, *idle, stdout, log)
		if errors.Is(err, ErrServing) {
			fmt.Fprintf(stderr, "%s: %v: this one exits\n", Name, err)
			return 0
		}
		if err != nil {
			fmt.Fprintf(stderr, "%s: %v\n", Name, err)
			return exitFailed
		}
		return 0
	case "ping":
		if *state == "" {
			fmt.Fprintln(stderr, "ping: -state is required")
			return exitUsage
		}
		inst, err := Ping(ctx, *state, *wait)
		if err != nil {
			fmt.Fprintf(stderr, "%s ping: %v\n", Name, err)
			return ExitNotServing
		}
		fmt.Fprintf(stdout, "%s%s\n", Ready, inst)
		return 0
	case "exchange":
		if *state == "" {
			fmt.Fprintln(stderr, "exchange: -state is required")
			return exitUsage
		}
		// stdout carries frames only; the helper's own messages go to
		// stderr, which the daemon reads as a log, not as control, and to
		// native.err in the sandbox.
		logw := stderr
		if f, err := os.Create(filepath.Join(*state, "native.err")); err == nil {
			defer f.Close()
			logw = io.MultiWriter(f, stderr)
		}
		o := ExchangeOptions{State: *state, Root: root, Path: *path}
		return Exchange(ctx, o, stdin, stdout, logw)
	}
	fmt.Fprintf(stderr, "%s: unknown command %q\n", Name, args[0])
	return exitUsage
}

// selfHash is the SHA-256 of the running executable: the daemon checks an
// upload arrived whole by it.
func selfHash() (string, error) {
	exe, err := os.Executable()
	if err != nil {
		return "", err
	}
	f, err := os.Open(exe)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

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
	"time"

	"github.com/sandboxd/sandboxd/internal/helperproto"
	"github.com/sandboxd/sandboxd/sandboxhelper/hold"
)

// Exit codes of stage beyond 0 (and helperproto.ExitDeclined...): the
// caller stages the whole tree itself.
const (
	exitFailed = 1
	exitUsage  = 2
)

// ExitNotServing: ping found no server of this binary for the checkout.
const ExitNotServing = helperproto.ExitNotServing

// Main is the program: `serve -state DIR [-idle D]`, `ping -state DIR
// [-wait D]`, `stage -state DIR -instance ID -index FILE [...]` or
// `version`, run in the checkout's root.
func Main(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprintln(stderr, "usage: sandboxd-helper serve|stage|version [flags]")
		return exitUsage
	}
	if args[0] == "hold" {
		// Durable execs (docs/durable-exec.md).
		self, err := os.Executable()
		if err != nil {
			fmt.Fprintf(stderr, "%s: %v\n", Name, err)
			return exitFailed
		}
		o := hold.Options{Self: self, Server: func(ctx context.Context, id string, req hold.SpawnRequest) error {
			return askHold(ctx, self, id, req)
		}, Stream: func(ctx context.Context, id string, req hold.SpawnRequest) (io.WriteCloser, io.Reader, error) {
			return askHoldStream(ctx, self, id, req)
		}}
		return hold.MainWith(ctx, o, args[1:], stdin, stdout, stderr)
	}
	fs := flag.NewFlagSet(Name+" "+args[0], flag.ContinueOnError)
	fs.SetOutput(stderr)
	state := fs.String("state", "", "the sync state directory (.git/sandboxd), absolute")
	var o StageOptions
	fs.StringVar(&o.Instance, "instance", "", "stage: the server to ask")
	fs.StringVar(&o.Index, "index", "", "stage: the sync index, absolute")
	fs.StringVar(&o.TreeHint, "tree-hint", "", "stage: the tree the index held before")
	fs.BoolVar(&o.PrintTree, "print-tree", false, "stage: print the index's tree")
	fs.StringVar(&o.Real, "real", "", "stage: the user's index, absolute")
	same := fs.Int("same-exit", 0, "stage: exit with this code when the index still holds -tree-hint (nothing was staged)")
	var push pushRequest
	fs.StringVar(&push.Head, "head", "", "stage: reset the user's index to this commit; push: the commit to push onto")
	fs.StringVar(&push.SnapRef, "snap-ref", "", "push: the snapshot's ref")
	fs.StringVar(&push.BaseRef, "base-ref", "", "push: the base's ref")
	fs.Int64Var(&push.Time, "time", 0, "push: the snapshot's time (Unix seconds)")
	var pull pullRequest
	fs.StringVar(&pull.Tree, "tree", "", "pull, adopt: the tree the push left")
	fs.StringVar(&pull.Out, "out", "", "pull: the patch file to write")
	path := fs.String("path", "", "exchange: the command's PATH")
	sready := fs.String("sready", "", "exchange: the tree whose stray edits' patch strayEdits made")
	c0 := fs.String("c0", "", "exchange: the tree strayEdits staged")
	idle := fs.Duration("idle", DefaultIdle, "serve: exit after this long without a question")
	wait := fs.Duration("wait", 0, "ping: wait this long for a server to answer")
	if err := fs.Parse(args[1:]); err != nil {
		return exitUsage
	}
	o.Head = push.Head
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
	case "stage":
		if *state == "" || o.Index == "" {
			fmt.Fprintln(stderr, "stage: -state and -index are required")
			return exitUsage
		}
		o.Root, o.State = root, *state
		ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
		defer cancel()
		res, err := Stage(ctx, o)
		if err != nil {
			fmt.Fprintf(stderr, "%s: %v\n", Name, err)
			return exitFailed
		}
		if o.PrintTree {
			fmt.Fprintln(stdout, res.Tree)
		}
		if *same != 0 && res.Same {
			return *same
		}
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
		o := ExchangeOptions{State: *state, Path: *path, PushEnv: []string{"sready=" + *sready, "c0=" + *c0}}
		return Exchange(ctx, o, stdin, stdout, logw)
	case "pull", "adopt":
		if *state == "" || o.Instance == "" {
			fmt.Fprintf(stderr, "%s: -state and -instance are required\n", args[0])
			return exitUsage
		}
		ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
		defer cancel()
		return native(ctx, args[0], *state, o.Instance, pull, fs.Args(), stderr)
	}
	fmt.Fprintf(stderr, "%s: unknown command %q\n", Name, args[0])
	return exitUsage
}

// native asks the server for a pull (the patch to pull.Out, git
// diff-tree's options as args) or an adopt (the working tree holds -tree);
// the push is run's. A declined question exits ExitDeclined.
func native(ctx context.Context, verb, state, instance string, pull pullRequest, args []string, stderr io.Writer) int {
	line := verb
	var body any
	switch verb {
	case "pull":
		pull.DiffArgs = args
		body = pull
	case "adopt":
		line += " " + pull.Tree
	}
	a, err := ask(ctx, state, instance, line, body)
	switch {
	case err != nil:
		fmt.Fprintf(stderr, "%s %s: %v\n", Name, verb, err)
		return exitFailed
	case a.Declined != "":
		fmt.Fprintf(stderr, "%s %s: %s\n", Name, verb, a.Declined)
		if a.ForGood {
			return ExitDeclinedForGood
		}
		return ExitDeclined
	}
	return 0
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

package sandboxhelper

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
)

// RunOptions say what run does: a native push, the user's command, a
// native pull, in one process (each process started in the sandbox is a
// cost every exec pays).
type RunOptions struct {
	State, Instance string
	// Push is the push's head, time and refs; its entries come apart,
	// undecoded (Run's entries).
	Push pushRequest
	// Pending is the exec's id: once the push is done it is marked
	// pending (<state>/pending), so that edits the command leaves are
	// brought back first by the next push if this exec's pull never
	// lands.
	Pending string
	// Path is the PATH the command runs with (the sandbox's own).
	Path string
	// Command is the shell command line, run by /bin/sh -c.
	Command string
	// Result is the file run writes what happened to, line by line:
	// "push <snapshot> <tree>" once the push is done (from then on the
	// command may run, and run's exit status is the command's), then
	// "pull" once the pull's patch is in Pull.Out, or "reported" once run
	// printed the exchange's report itself (Report).
	Result string
	Pull   pullRequest
	// Report, when set, has run print the exchange's report after its
	// pull; without it the wrapper does.
	Report *Report
}

// Run carries out o with the push's entries (their JSON). Before the push
// line is written it returns ExitDeclined or ExitDeclinedForGood when the
// push declined, another code when it failed: the command did not run.
// After, it returns the command's status as a shell reports it (128+n for
// signal n), whatever became of the pull (its line says it was done). Its
// own messages go to log; stdin, stdout and stderr are the command's.
func Run(ctx context.Context, log io.Writer, o RunOptions, entries []byte, stdin io.Reader, stdout, stderr io.Writer) int {
	// The signals a command's process group gets from the exec's caller
	// (the agent relays them): run outlives them, as the command's wrapper
	// does, to report the command's end and pull its edits. One before the
	// command started stops run without starting it.
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGHUP, syscall.SIGINT, syscall.SIGQUIT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	// The caller's context ends on those signals: run decides itself.
	ctx = context.WithoutCancel(ctx)

	// The entries go to the server as they came: the server decodes them,
	// run only checks that they are JSON (decoding and encoding them here
	// too was reflection in a fresh process on every exec).
	var err error
	switch {
	case len(entries) > maxRequest:
		err = fmt.Errorf("%d bytes, over the %d a request may carry", len(entries), maxRequest)
	case !json.Valid(entries):
		err = errors.New("not JSON")
	}
	if err != nil {
		fmt.Fprintf(log, "%s run: read the entries: %v\n", Name, err)
		return exitUsage
	}
	res, err := os.OpenFile(o.Result, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		fmt.Fprintf(log, "%s run: %v\n", Name, err)
		return exitFailed
	}
	defer res.Close()
	a, err := ask(ctx, o.State, o.Instance, "push", forwardedPush{Head: o.Push.Head, Entries: entries, Time: o.Push.Time, SnapRef: o.Push.SnapRef, BaseRef: o.Push.BaseRef})
	switch {
	case err != nil:
		fmt.Fprintf(log, "%s run: %v\n", Name, err)
		return exitFailed
	case a.Declined != "":
		fmt.Fprintf(log, "%s run: %s\n", Name, a.Declined)
		if a.ForGood {
			return ExitDeclinedForGood
		}
		return ExitDeclined
	}
	if o.Pending != "" {
		if err := os.WriteFile(filepath.Join(o.State, "pending"), []byte(o.Pending+"\n"), 0o644); err != nil {
			fmt.Fprintf(log, "%s run: mark the exec pending: %v\n", Name, err)
			return exitFailed
		}
	}
	if _, err := fmt.Fprintf(res, "push %s %s\n", a.Snap, a.Tree); err != nil {
		fmt.Fprintf(log, "%s run: %v\n", Name, err)
		return exitFailed
	}
	select {
	case s := <-sigs:
		return 128 + int(s.(syscall.Signal))
	default:
	}
	if o.Report != nil {
		// Before the command, so that nothing it prints can come first.
		if _, err := io.WriteString(stdout, StartMark(o.Report.Nonce)); err != nil {
			fmt.Fprintf(log, "%s run: %v\n", Name, err)
		}
	}

	status := runCommand(o, stdin, stdout, stderr)
	o.Pull.Tree = a.Tree
	if _, err := ask(ctx, o.State, o.Instance, "pull", o.Pull); err != nil {
		// The wrapper finds no pull line: the plain pull follows.
		fmt.Fprintf(log, "%s run: %v\n", Name, err)
		return status
	}
	if o.Report != nil {
		if err := report(o, a.Snap, status, stdout); err != nil {
			// The wrapper prints it the plain way (after a part of it,
			// the daemon finds the report damaged and fetches the patch
			// again).
			fmt.Fprintf(log, "%s run: %v\n", Name, err)
		} else {
			_, _ = fmt.Fprintln(res, "reported")
			return status
		}
	}
	_, _ = fmt.Fprintln(res, "pull")
	return status
}

// forwardedPush is a pushRequest whose entries run passes on undecoded.
type forwardedPush struct {
	Head    string          `json:"head"`
	Entries json.RawMessage `json:"entries"`
	Time    int64           `json:"time"`
	SnapRef string          `json:"snap_ref"`
	BaseRef string          `json:"base_ref"`
}

// runCommand runs the user's command with run's streams and returns its
// status as a shell reports it.
func runCommand(o RunOptions, stdin io.Reader, stdout, stderr io.Writer) int {
	cmd := exec.Command("/bin/sh", "-c", o.Command)
	cmd.Env = withPath(os.Environ(), o.Path)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, stdout, stderr
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return 128 + int(ws.Signal())
		}
		return ee.ExitCode()
	}
	fmt.Fprintf(stderr, "sh: %v\n", err)
	return 127
}

// withPath is env with PATH set to path.
func withPath(env []string, path string) []string {
	out := make([]string, 0, len(env)+1)
	for _, kv := range env {
		if !strings.HasPrefix(kv, "PATH=") {
			out = append(out, kv)
		}
	}
	return append(out, "PATH="+path)
}

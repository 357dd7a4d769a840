// Package provision prepares a localcloud sandbox: it reads the run's
// config, clones the repository at the run's commit into the workspace and
// runs the setup steps that come before the sandbox task.
package provision

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"time"

	"gopkg.in/yaml.v3"
)

// SandboxRun is the `run:` value of the task that marks where the sandbox
// becomes available.
const SandboxRun = "rwx-sandbox"

// Definition is what localcloud acts on in a sandbox config.
type Definition struct {
	// Steps are the tasks with a `run:` that come before the sandbox task,
	// in file order.
	Steps []Step
	// SandboxKey is the key of the sandbox task.
	SandboxKey string
	// Env is the sandbox task's `env:`: the environment its commands get
	// on top of localcloud's (a PATH here replaces localcloud's).
	Env map[string]string
}

// Step is one setup command.
type Step struct {
	Key string
	Run string
	// Env is the task's `env:`, on top of localcloud's environment.
	Env map[string]string
}

type configFile struct {
	Tasks []struct {
		Key  string              `yaml:"key"`
		Run  string              `yaml:"run"`
		Call string              `yaml:"call"`
		Use  any                 `yaml:"use"`
		Env  map[string]envValue `yaml:"env"`
	} `yaml:"tasks"`
}

// envValue is one `env:` entry: a string, or, as RWX writes it, a mapping
// whose `value` is the string (`cache-key` is for RWX's cache).
type envValue struct{ v string }

func (e *envValue) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode {
		return n.Decode(&e.v)
	}
	var m struct {
		Value *string `yaml:"value"`
	}
	if err := n.Decode(&m); err != nil || m.Value == nil {
		return fmt.Errorf("line %d: an env value is a string or a mapping with `value:`", n.Line)
	}
	e.v = *m.Value
	return nil
}

// envName is what a shell accepts as a variable name.
var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// maxEnv bounds one task's env (names and values together).
const maxEnv = 64 << 10

func taskEnv(key string, in map[string]envValue) (map[string]string, error) {
	if len(in) == 0 {
		return nil, nil
	}
	out := make(map[string]string, len(in))
	size := 0
	for k, v := range in {
		if !envName.MatchString(k) {
			return nil, fmt.Errorf("%w: task %s: env name %q is not a variable name (letters, digits and _, not starting with a digit)", ErrInvalidConfig, key, k)
		}
		if strings.IndexByte(v.v, 0) >= 0 {
			return nil, fmt.Errorf("%w: task %s: env %s holds a NUL byte", ErrInvalidConfig, key, k)
		}
		size += len(k) + len(v.v) + 2
		out[k] = v.v
	}
	if size > maxEnv {
		return nil, fmt.Errorf("%w: task %s: env is %d bytes, over %d", ErrInvalidConfig, key, size, maxEnv)
	}
	return out, nil
}

// ErrInvalidConfig is wrapped by every config error (a 400 for the API).
var ErrInvalidConfig = errors.New("invalid sandbox config")

// ParseConfig reads a sandbox config (the RWX run definition YAML). Tasks
// that `call:` packages (git/clone and the like) are skipped: localcloud
// clones the repository itself and has no package registry.
func ParseConfig(contents []byte) (Definition, error) {
	var cf configFile
	if err := yaml.Unmarshal(contents, &cf); err != nil {
		return Definition{}, fmt.Errorf("%w: not valid YAML: %v", ErrInvalidConfig, err)
	}
	if len(cf.Tasks) == 0 {
		return Definition{}, fmt.Errorf("%w: no tasks: add a task with `run: %s`", ErrInvalidConfig, SandboxRun)
	}
	var d Definition
	for i, t := range cf.Tasks {
		key := t.Key
		if key == "" {
			key = fmt.Sprintf("task-%d", i+1)
		}
		env, err := taskEnv(key, t.Env)
		if err != nil {
			return Definition{}, err
		}
		before, isSandbox, err := sandboxTask(t.Run)
		if err != nil {
			return Definition{}, fmt.Errorf("%w: task %q: %v", ErrInvalidConfig, key, err)
		}
		if isSandbox {
			if before != "" {
				d.Steps = append(d.Steps, Step{Key: key, Run: before, Env: env})
			}
			d.SandboxKey, d.Env = t.Key, env
			return d, nil
		}
		if strings.TrimSpace(t.Run) == "" {
			continue
		}
		d.Steps = append(d.Steps, Step{Key: key, Run: t.Run, Env: env})
	}
	return Definition{}, fmt.Errorf("%w: no task with `run: %s`: add one after the setup tasks", ErrInvalidConfig, SandboxRun)
}

// sandboxTask reports whether run is the sandbox task's script: its last
// non-blank line is exactly rwx-sandbox. The lines before it are commands
// RWX runs first, in the same task (before); they are returned to run as a
// step of that task. A script that goes on after rwx-sandbox is refused:
// localcloud hands the sandbox over where rwx-sandbox stands and has no
// place to run what follows.
func sandboxTask(run string) (before string, ok bool, err error) {
	lines := strings.Split(strings.TrimRight(run, " \t\r\n"), "\n")
	last := len(lines) - 1
	for i, l := range lines {
		if strings.TrimSpace(l) != SandboxRun {
			continue
		}
		if i != last {
			return "", false, fmt.Errorf("commands after `%s` are not supported: move them before it", SandboxRun)
		}
		return strings.TrimSpace(strings.Join(lines[:i], "\n")), true, nil
	}
	return "", false, nil
}

// CloneOptions locate the repository to check out.
type CloneOptions struct {
	Origin string // a local path or any URL git can reach
	Sha    string // empty: the origin's default branch
	Branch string // checked out at Sha when it is a valid branch name
	Dest   string // must not exist yet
	// Env for git (the server's own, so the user's credentials work);
	// nil means the current process environment.
	Env []string
	Log io.Writer
}

var hexSha = regexp.MustCompile(`^[0-9a-fA-F]{4,64}$`)

// ValidSha reports whether s can be a commit id.
func ValidSha(s string) bool { return s == "" || hexSha.MatchString(s) }

// Clone checks the repository out at the requested commit.
func Clone(ctx context.Context, o CloneOptions) error {
	if !ValidSha(o.Sha) {
		return fmt.Errorf("git sha %q is not a commit id", o.Sha)
	}
	env := o.Env
	if env == nil {
		env = os.Environ()
	}
	env = append(env, "GIT_TERMINAL_PROMPT=0", "GIT_ASKPASS=/bin/false", "GCM_INTERACTIVE=never")
	git := func(args ...string) ([]byte, error) {
		cmd := command(ctx, "git", args...)
		cmd.Env = env
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if o.Log != nil {
			fmt.Fprintf(o.Log, "$ git %s\n", strings.Join(args, " "))
			w := io.MultiWriter(&out, o.Log)
			cmd.Stdout, cmd.Stderr = w, w
		}
		err := cmd.Run()
		if ctx.Err() != nil {
			return out.Bytes(), ctx.Err()
		}
		return out.Bytes(), err
	}
	if out, err := git("clone", "--quiet", "--no-checkout", "--", o.Origin, o.Dest); err != nil {
		if ctx.Err() != nil || !isLocalPath(o.Origin) {
			return fmt.Errorf("clone the repository from git.origin_url %q: %s", o.Origin, tail(out, err))
		}
		// A clone by path copies (or links) the object files one by one,
		// and git's background maintenance in the user's repository (gc
		// --auto after a large commit) may pack and delete them meanwhile.
		// Through git's transport instead, upload-pack reads objects the
		// way every git reader does, which survives a concurrent gc.
		if rerr := os.RemoveAll(o.Dest); rerr != nil {
			return fmt.Errorf("clone the repository from git.origin_url %q: %s; and removing the failed clone: %v", o.Origin, tail(out, err), rerr)
		}
		if out2, err2 := git("clone", "--quiet", "--no-checkout", "--no-local", "--", o.Origin, o.Dest); err2 != nil {
			return fmt.Errorf("clone the repository from git.origin_url %q: %s (and again through git's transport: %s)", o.Origin, tail(out, err), tail(out2, err2))
		}
	}
	ref := "HEAD"
	if o.Sha != "" {
		ref = o.Sha
		if out, err := git("-C", o.Dest, "cat-file", "-e", o.Sha+"^{commit}"); err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("commit %s is not in %s (push it, then start the sandbox again): %s", o.Sha, o.Origin, tail(out, err))
		}
	}
	args := []string{"-C", o.Dest, "checkout", "--quiet", "--detach", ref}
	if o.Branch != "" && o.Sha != "" {
		check := command(ctx, "git", "check-ref-format", "--branch", o.Branch)
		check.Env = env
		if check.Run() == nil {
			args = []string{"-C", o.Dest, "checkout", "--quiet", "-B", o.Branch, ref}
		}
	}
	if out, err := git(args...); err != nil {
		return fmt.Errorf("check out %s in %s: %s", ref, o.Dest, tail(out, err))
	}
	return nil
}

// StepError is a setup step that failed.
type StepError struct {
	Key    string
	Err    error // the exit error
	Output string
}

func (e *StepError) Error() string {
	msg := fmt.Sprintf("setup step %q failed: %v", e.Key, e.Err)
	if e.Output != "" {
		msg += "\n" + e.Output
	}
	return msg
}

func (e *StepError) Unwrap() error { return e.Err }

// RunSteps runs steps in order under /bin/sh in dir with env, logging to
// log; the first failure stops and is returned as a *StepError carrying the
// tail of its output.
func RunSteps(ctx context.Context, steps []Step, dir string, env []string, log io.Writer) error {
	return RunStepsIn(ctx, nil, steps, dir, env, log)
}

// Commander builds the command that runs argv in dir (the run's sandbox).
type Commander func(ctx context.Context, dir string, argv ...string) *exec.Cmd

// RunStepsIn is RunSteps with each step's command built by newCmd (plain
// processes when nil).
func RunStepsIn(ctx context.Context, newCmd Commander, steps []Step, dir string, env []string, log io.Writer) error {
	if log == nil {
		log = io.Discard
	}
	for _, s := range steps {
		fmt.Fprintf(log, "==> %s\n$ %s\n", s.Key, s.Run)
		var out tailBuffer
		var cmd *exec.Cmd
		if newCmd == nil {
			cmd = command(ctx, "/bin/sh", "-c", s.Run)
			cmd.Dir = dir
		} else {
			cmd = inGroup(newCmd(ctx, dir, "/bin/sh", "-c", s.Run))
		}
		cmd.Env = WithEnv(env, s.Env)
		// One writer: exec shares one pipe. The run log (localcloud's
		// disk, outside the run's disk limit) gets at most
		// MaxStepLogBytes of a step's output.
		w := io.MultiWriter(&cappedWriter{w: log, n: MaxStepLogBytes}, &out)
		cmd.Stdout, cmd.Stderr = w, w
		start := time.Now()
		err := cmd.Run()
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err != nil {
			fmt.Fprintf(log, "==> %s failed after %s: %v\n", s.Key, time.Since(start).Round(time.Millisecond), err)
			return &StepError{Key: s.Key, Err: err, Output: strings.TrimSpace(out.String())}
		}
		fmt.Fprintf(log, "==> %s done in %s\n", s.Key, time.Since(start).Round(time.Millisecond))
	}
	return nil
}

// command runs name in its own process group, killed as a whole when ctx
// ends (a cancelled run leaves nothing behind).
func command(ctx context.Context, name string, args ...string) *exec.Cmd {
	return inGroup(exec.CommandContext(ctx, name, args...))
}

// inGroup makes cmd (built with a context) lead its own session (so its
// own process group, killed as a whole when the context ends), without a
// controlling terminal: a setup step never reaches the terminal localcloud
// was started from.
func inGroup(cmd *exec.Cmd) *exec.Cmd {
	cmd.SysProcAttr = dieWithServer(&syscall.SysProcAttr{Setsid: true})
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 2 * time.Second
	return cmd
}

// isLocalPath reports whether a clone source is a path on this machine
// (not a URL or scp-like address), which git clones by copying files.
func isLocalPath(origin string) bool {
	if strings.Contains(origin, "://") {
		return false
	}
	if i := strings.IndexByte(origin, ':'); i > 0 && !strings.ContainsRune(origin[:i], '/') {
		return false // host:path
	}
	return true
}

func tail(out []byte, err error) string {
	s := strings.TrimSpace(string(out))
	if len(s) > 2000 {
		s = "..." + s[len(s)-2000:]
	}
	if s == "" {
		return err.Error()
	}
	return s
}

// MaxStepLogBytes bounds what the run log keeps of one setup step's
// output; the rest is dropped, said once.
const MaxStepLogBytes = 16 << 20

// cappedWriter passes the first n bytes to w, then says the rest is
// dropped; it never fails the writer.
type cappedWriter struct {
	w    io.Writer
	n    int64
	said bool
}

func (c *cappedWriter) Write(p []byte) (int, error) {
	if c.n <= 0 {
		if !c.said {
			c.said = true
			fmt.Fprintf(c.w, "\n==> (the rest of this step's output is not logged: over %d bytes)\n", MaxStepLogBytes)
		}
		return len(p), nil
	}
	q := p
	if int64(len(q)) > c.n {
		q = q[:c.n]
	}
	c.n -= int64(len(q))
	_, _ = c.w.Write(q)
	return len(p), nil
}

// tailBuffer keeps the last 4 KiB written to it.
type tailBuffer struct{ b []byte }

const tailMax = 4096

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.b = append(t.b, p...)
	if len(t.b) > tailMax {
		t.b = append(t.b[:0], t.b[len(t.b)-tailMax:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string { return string(t.b) }

// WithEnv is base with the variables of over set (replaced or added), in
// a stable order; base is not changed. Each name appears once: a process
// reading its environment with getenv sees the first of duplicates.
func WithEnv(base []string, over map[string]string) []string {
	if len(over) == 0 {
		return base
	}
	out := make([]string, 0, len(base)+len(over))
	for _, kv := range base {
		name, _, _ := strings.Cut(kv, "=")
		if _, ok := over[name]; !ok {
			out = append(out, kv)
		}
	}
	names := make([]string, 0, len(over))
	for k := range over {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		out = append(out, k+"="+over[k])
	}
	return out
}

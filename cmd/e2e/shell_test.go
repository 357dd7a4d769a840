package e2e

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// tmuxPane is one tmux server (its own socket) with one pane running a
// command: keys go in, the screen comes out.
type tmuxPane struct {
	t    *testing.T
	bin  string
	sock string
	env  []string
}

func (e *env) tmux(t *testing.T, dir, command string) *tmuxPane {
	t.Helper()
	bin := needTool(t, "tmux", "apt-get install tmux")
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	p := &tmuxPane{t: t, bin: bin, sock: "nooke2e-" + hex.EncodeToString(b), env: e.with("TERM=xterm-256color")}
	t.Cleanup(func() { _ = exec.Command(bin, "-L", p.sock, "kill-server").Run() })
	p.run("-f", "/dev/null", "new-session", "-d", "-x", "100", "-y", "30", "-c", dir, command)
	return p
}

func (p *tmuxPane) run(args ...string) string {
	p.t.Helper()
	cmd := exec.Command(p.bin, append([]string{"-L", p.sock}, args...)...)
	cmd.Env = p.env
	out, err := cmd.CombinedOutput()
	if err != nil {
		p.t.Fatalf("tmux %v: %v\n%s", args, err, out)
	}
	return string(out)
}

// keys types into the pane (tmux key names: Enter, C-c, ...).
func (p *tmuxPane) keys(keys ...string) {
	p.t.Helper()
	p.run(append([]string{"send-keys", "-t", "0"}, keys...)...)
}

// line types a line and presses Enter.
func (p *tmuxPane) line(s string) { p.t.Helper(); p.keys("-l", s); p.keys("Enter") }

func (p *tmuxPane) screen() string {
	p.t.Helper()
	return p.run("capture-pane", "-p", "-J", "-S", "-200", "-t", "0")
}

// waitFor waits until the screen matches re (an output only the remote
// side can produce, such as an evaluated $((...))).
func (p *tmuxPane) waitFor(re string) string {
	p.t.Helper()
	rx := regexp.MustCompile(re)
	deadline := time.Now().Add(30 * time.Second)
	for {
		s := p.screen()
		if m := rx.FindString(s); m != "" {
			return m
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("the terminal never showed %q; screen:\n%s", re, s)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestShellUnderPseudoTerminal types into `nook shell` running in a real
// terminal (tmux): the remote side has a tty with the caller's TERM and
// size, follows a resize, gets Ctrl-C, Ctrl-Z and Ctrl-D as keys (so the
// remote job is interrupted, stopped and its stdin ended, while nook lives
// on), syncs both ways, exits with the shell's status, and leaves the
// local terminal as it found it (cooked, echoing).
func TestShellUnderPseudoTerminal(t *testing.T) {
	t.Parallel()
	// Under the local remote's default isolation: the shell leads its own
	// session inside the sandbox's namespaces, so its job control (Ctrl-Z,
	// kill %1) can give the terminal back at exit and the status is 7.
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("shell", defaultConfig)
	writeFile(t, filepath.Join(repo, "local.txt"), "from the laptop\n")
	p := e.tmux(t, repo, "nook shell; echo EXIT=$?; stty -a; sleep 600")

	p.line("echo READY-$((40+2)); tty; echo TERM=$TERM; stty size; cat local.txt")
	p.waitFor(`READY-42`)
	p.waitFor(`from the laptop`)
	if s := p.screen(); !regexp.MustCompile(`/dev/pts/\d+`).MatchString(s) || !strings.Contains(s, "TERM=xterm-256color") && !strings.Contains(s, "TERM=tmux") && !strings.Contains(s, "TERM=screen") {
		t.Fatalf("the remote side has no terminal, or not the caller's TERM:\n%s", s)
	}
	p.waitFor(`(?m)^30 100\s*$`)

	// The new size travels (SIGWINCH, a resize frame, window-change) while
	// the shell reads the next line: ask until the remote side has it.
	p.run("resize-window", "-t", "0", "-x", "120", "-y", "40")
	for i := 1; ; i++ {
		p.line(fmt.Sprintf("echo SIZE-$((%d+0)) $(stty size)", i))
		if got := p.waitFor(fmt.Sprintf(`SIZE-%d \d+ \d+`, i)); got == fmt.Sprintf("SIZE-%d 40 120", i) {
			break
		}
		if i == 100 {
			t.Fatalf("the remote terminal never got the new size:\n%s", p.screen())
		}
	}

	// Ctrl-C interrupts the remote command, not nook. The key goes once the
	// command runs (it says so, then becomes sleep in the same process).
	p.line("sh -c 'echo C-$((0+1)); exec sleep 300'")
	p.waitFor(`C-1`)
	p.keys("C-c")
	p.line("echo INT-$((2+2))")
	p.waitFor(`INT-4`)
	// Ctrl-Z stops the remote job (the remote shell's job control).
	p.line("sh -c 'echo Z-$((0+1)); exec sleep 300'")
	p.waitFor(`Z-1`)
	p.keys("C-z")
	p.line("echo Z-$((3+3)); kill -9 %1")
	p.waitFor(`Z-6`)
	// Ctrl-D ends the remote command's input. The text is typed once the
	// shell has given the terminal back its cooked mode (it has when the
	// command line prints): keys typed ahead of that land while readline
	// holds the terminal raw, where ^D is a byte, not an end of file.
	p.line("echo CAT-$((3+4)); cat > typed.txt")
	p.waitFor(`CAT-7`)
	p.line("typed remotely")
	p.keys("C-d")
	p.line("echo D-$((4+4)); exit 7")
	p.waitFor(`D-8`)
	p.waitFor(`EXIT=7`)
	s := p.screen()
	tail := s[strings.Index(s, "EXIT=7"):]
	if !regexp.MustCompile(`(^|\s)icanon\b`).MatchString(tail) || !regexp.MustCompile(`(^|\s)echo\b`).MatchString(tail) {
		t.Fatalf("the local terminal was not restored (want icanon and echo):\n%s", tail)
	}
	if got := readFile(t, filepath.Join(repo, "typed.txt")); got != "typed remotely\n" {
		t.Fatalf("the file the shell wrote did not come back: %q", got)
	}
}

// TestExecTTYNeedsATerminal: exec -t without a terminal on stdin says what
// to do instead of hanging or garbling.
func TestExecTTYNeedsATerminal(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("notty", defaultConfig)
	r := e.nook(repo, "exec", "-t", "--", "true")
	if r.code != 125 || !strings.Contains(r.stderr, "needs a terminal") {
		t.Fatalf("exec -t without a terminal: %s", r)
	}
	r = e.nook(repo, "shell")
	if r.code != 125 || !strings.Contains(r.stderr, "needs a terminal") {
		t.Fatalf("shell without a terminal: %s", r)
	}
}

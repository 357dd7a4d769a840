package cli

import (
	"context"
	"fmt"
	"io"
	"strings"
)

// synopsis is the usage line of c, e.g. "nook exec [flags] [config] -- CMD".
func synopsis(c *command) string {
	s := c.synopsisName()
	if len(c.visible()) > 0 {
		s += " COMMAND"
	}
	s += " [flags]"
	if c.args != "" {
		s += " " + c.args
	}
	return s
}

// sentence is s with a capital letter and a final period.
func sentence(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:] + "."
}

// flagLabel is "-i, --interactive" or "--id RUN".
func flagLabel(f flagSpec) string {
	name := "--" + f.name
	if f.short != "" {
		name = "-" + f.short + ", " + name
	}
	if f.arg != "" {
		name += " " + f.arg
	}
	return name
}

// wrap breaks text into lines of at most width columns, keeping its own
// line breaks.
func wrap(text string, width int, indent string) string {
	var b strings.Builder
	for _, para := range strings.Split(text, "\n") {
		line := indent
		for _, w := range strings.Fields(para) {
			if len(line) > len(indent) && len(line)+1+len(w) > width {
				b.WriteString(strings.TrimRight(line, " ") + "\n")
				line = indent
			}
			if len(line) > len(indent) {
				line += " "
			}
			line += w
		}
		b.WriteString(line + "\n")
	}
	return b.String()
}

// printHelp writes the help of c (the root or any command).
func printHelp(w io.Writer, c *command) {
	fmt.Fprintf(w, "Usage: %s\n\n", synopsis(c))
	if c.isRoot() {
		fmt.Fprint(w, wrap(c.long, 78, ""))
	} else {
		fmt.Fprint(w, sentence(c.summary)+"\n")
		if c.long != "" {
			fmt.Fprint(w, "\n"+wrap(c.long, 78, ""))
		}
	}
	if subs := c.visible(); len(subs) > 0 {
		fmt.Fprintln(w, "\nCommands:")
		for _, s := range subs {
			fmt.Fprintf(w, "  %-14s %s\n", s.name, s.summary)
		}
		if c.isRoot() {
			fmt.Fprintln(w, "\nRun `nook help COMMAND` (or `nook COMMAND --help`) for a command's flags.")
		}
	}
	if len(c.flags) > 0 {
		fmt.Fprintln(w, "\nFlags:")
		printFlags(w, c.flags)
	}
	global := globalFlags()
	if c.isRoot() {
		global = append(global, versionFlag())
	}
	fmt.Fprintln(w, "\nGlobal flags (before or after the command):")
	printFlags(w, global)
	if c.isRoot() {
		fmt.Fprint(w, "\nExit status:\n"+wrap(exitStatusText, 78, "  "))
		fmt.Fprint(w, "\nEnvironment:\n")
		for _, e := range environment {
			fmt.Fprintf(w, "  %-22s %s\n", e[0], e[1])
		}
	}
}

func printFlags(w io.Writer, flags []flagSpec) {
	for _, f := range flags {
		fmt.Fprintf(w, "  %-24s %s\n", flagLabel(f), f.help)
	}
}

const exitStatusText = "the remote command's status for nook exec (128+n when signal n ended it); " +
	"0 on success; 3 for `nook daemon status` when no daemon runs; " +
	"125 when nook or sandboxd failed before the command ran."

// environment lists the variables nook reads.
var environment = [][2]string{
	{"SANDBOXD_SOCKET", "the daemon's socket path"},
	{"SANDBOXD_NO_AUTOSTART", "1: never start sandboxd in the background"},
	{"XDG_RUNTIME_DIR", "where the socket lives by default"},
	{"XDG_STATE_HOME", "where the daemon's state and log live"},
	{"XDG_CONFIG_HOME", "where the daemon's config.json lives"},
}

// help is `nook help [COMMAND...]`.
func (a *app) help(ctx context.Context) int {
	c := a.root.find(a.p.args)
	if c == nil {
		return a.usage(&usageError{cmd: a.p.cmd, msg: fmt.Sprintf("unknown command %q: run `nook help` for the list", strings.Join(a.p.args, " "))})
	}
	printHelp(a.sys.Stdout, c)
	return ExitOK
}

// completion is `nook completion SHELL`.
func (a *app) completion(ctx context.Context) int {
	if len(a.p.args) == 0 {
		return a.usage(&usageError{cmd: a.p.cmd, msg: "name the shell: nook completion bash|zsh|fish"})
	}
	var err error
	switch a.p.args[0] {
	case "bash":
		err = writeBash(a.sys.Stdout, a.root)
	case "zsh":
		err = writeZsh(a.sys.Stdout, a.root)
	case "fish":
		err = writeFish(a.sys.Stdout, a.root)
	}
	if err != nil {
		return a.fail(fmt.Errorf("write the completion script: %w", err))
	}
	return ExitOK
}

// man is `nook man`.
func (a *app) man(ctx context.Context) int {
	if err := writeMan(a.sys.Stdout, a.root, a.sys.Version); err != nil {
		return a.fail(fmt.Errorf("write the man page: %w", err))
	}
	return ExitOK
}

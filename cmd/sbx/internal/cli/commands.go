package cli

import (
	"fmt"
	"io"
	"strings"
)

func idFlag() flagSpec {
	return flagSpec{name: "id", kind: stringFlag, arg: "RUN", help: "the sandbox run to use instead of the one of this checkout"}
}

func waitFlags() []flagSpec {
	return []flagSpec{
		{name: "wait", kind: boolFlag, help: "wait until the sandbox is ready"},
		{name: "timeout", kind: stringFlag, arg: "DURATION", help: "how long --wait waits (default 10m)"},
		{name: "init", kind: listFlag, arg: "KEY=VALUE", help: "an init parameter of the run (repeatable)"},
	}
}

// commands is the table of sbx commands.
func commands() []*command {
	return []*command{
		{name: "version", summary: "print the versions of sbx and sandboxd", autoStart: true, run: (*app).version},
		{name: "daemon status", summary: "show whether sandboxd runs, and its health (exit 3 when it does not)", run: (*app).daemonStatus},
		{name: "daemon stop", summary: "stop sandboxd (in-flight commands finish first)", run: (*app).daemonStop},
		{name: "config", summary: "show the effective remote (never the token)", autoStart: true, run: (*app).config},
		{name: "start", args: "[config]", maxArgs: 1, autoStart: true, run: (*app).start,
			summary: "start the sandbox of this checkout, branch and config (or report the active one)",
			flags:   append([]flagSpec{idFlag()}, waitFlags()...)},
		{name: "exec", args: "[config] -- CMD [ARG...]", maxArgs: 1, argv: true, autoStart: true, run: (*app).exec,
			summary: "run a command in the sandbox, with your changes synced both ways",
			flags: []flagSpec{idFlag(),
				{name: "no-sync", kind: boolFlag, help: "do not sync local changes to the sandbox and back"},
				{name: "interactive", short: "i", kind: boolFlag, help: "forward stdin even when it is a terminal"},
			}},
		{name: "list", summary: "list sandboxes", autoStart: true, run: (*app).list,
			flags: []flagSpec{{name: "all", kind: boolFlag, help: "include ended sandboxes kept as history"}}},
		{name: "stop", args: "[config]", maxArgs: 1, autoStart: true, run: (*app).stop,
			summary: "stop the sandbox of this checkout (idempotent)",
			flags:   []flagSpec{idFlag(), {name: "all", kind: boolFlag, help: "stop every sandbox"}}},
		{name: "reset", args: "[config]", maxArgs: 1, autoStart: true, run: (*app).reset,
			summary: "stop the sandbox of this checkout and start a new one",
			flags:   waitFlags()},
		{name: "init", args: "[file]", maxArgs: 1, autoStart: true, run: (*app).init,
			summary: "write a sandbox config from the remote's template (default .rwx/sandbox.yml)"},
		{name: "status", args: "[config]", maxArgs: 1, autoStart: true, run: (*app).status,
			summary: "probe the sandbox of this checkout",
			flags:   []flagSpec{idFlag()}},
		{name: "events", summary: "follow the daemon's events", autoStart: true, run: (*app).events,
			flags: []flagSpec{{name: "since", kind: stringFlag, arg: "SEQ", help: "replay buffered events after sequence number SEQ first"}}},
	}
}

func synopsis(c *command) string {
	s := "sbx " + c.name
	if len(c.flags) > 0 {
		s += " [flags]"
	}
	if c.args != "" {
		s += " " + c.args
	}
	return s
}

func printHelp(w io.Writer, cmds []*command) {
	fmt.Fprint(w, `sbx runs commands in a remote sandbox through the sandboxd daemon.

Usage: sbx [--json] COMMAND [flags] [args]

Commands:
`)
	for _, c := range cmds {
		fmt.Fprintf(w, "  %-14s %s\n", c.name, c.summary)
	}
	fmt.Fprint(w, `
Global flags (before or after the command):
  --json         print machine-readable JSON on stdout
  -h, --help     show help

Exit codes: the remote command's status (128+n when a signal ended it);
125 when sbx or sandboxd failed before the command ran.
Environment: SANDBOXD_SOCKET (socket path), SANDBOXD_NO_AUTOSTART=1 (never
start sandboxd), XDG_RUNTIME_DIR, XDG_STATE_HOME.
`)
}

func printCommandHelp(w io.Writer, c *command) {
	fmt.Fprintf(w, "Usage: %s\n\n%s.\n", synopsis(c), strings.ToUpper(c.summary[:1])+c.summary[1:])
	flags := append(append([]flagSpec{}, c.flags...), globalFlags()...)
	fmt.Fprintln(w, "\nFlags:")
	for _, f := range flags {
		name := "--" + f.name
		if f.short != "" {
			name = "-" + f.short + ", " + name
		}
		if f.arg != "" {
			name += " " + f.arg
		}
		fmt.Fprintf(w, "  %-24s %s\n", name, f.help)
	}
	if c.name == "exec" {
		fmt.Fprint(w, `
The command after -- reaches the sandbox's shell with every argument exactly
as given (spaces, quotes, $, globs and newlines are not interpreted). stdin is
forwarded when it is not a terminal (or with -i). Ctrl-C sends SIGINT to the
remote command; a second Ctrl-C within 2s disconnects, which cancels it.
`)
	}
}

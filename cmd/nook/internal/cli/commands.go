package cli

// The command table below is the ONE definition of nook's command line.
// Parsing, `nook --help`, `nook help CMD`, `nook CMD --help`, the bash, zsh and
// fish completions (`nook completion SHELL`) and the man page (`nook man`,
// `make man`) are all generated from it; TestGeneratedDocsCoverTable checks
// that every command and flag appears in each.
//
// To add a command, add ONE entry to root() (or to the subs of its parent,
// for `nook bg logs`-style subcommands) and write its run method on *app:
//
//	{name: "push", summary: "push local changes to the sandbox without running anything",
//	 args: "[config]", maxArgs: 1, argCompl: complYAML, autoStart: true,
//	 flags: []flagSpec{idFlag(), {name: "force", kind: boolFlag, help: "..."}},
//	 run: (*app).push},
//
// Rules: summary is one lower-case line without a final period; every flag
// has help (and arg, compl for flags with a value); `--json`, `--quiet` and
// `--help` are global (globalFlags) and need no entry; with --json the run
// method prints JSON on stdout only and returns errors through a.fail (which
// prints them as JSON objects). Nothing else needs editing: completions, help
// and the man page pick the entry up.

// idFlag is --id RUN, shared by the commands that take a run instead of the
// checkout's session.
func idFlag() flagSpec {
	return flagSpec{name: "id", kind: stringFlag, arg: "RUN", help: "the sandbox run to use instead of the one of this checkout"}
}

// discardFlag ends a sandbox without pulling its edits first.
func discardFlag() flagSpec {
	return flagSpec{name: "discard", kind: boolFlag, help: "do not pull the sandbox's edits first: drop them (the output lists them)"}
}

func waitFlags() []flagSpec {
	return []flagSpec{
		{name: "wait", kind: boolFlag, help: "wait until the sandbox is ready"},
		{name: "timeout", kind: stringFlag, arg: "DURATION", help: "how long --wait waits (default 10m)"},
		{name: "init", kind: listFlag, arg: "KEY=VALUE", help: "an init parameter of the run (repeatable)"},
	}
}

// shells are the shells `nook completion` writes scripts for.
var shells = []string{"bash", "zsh", "fish"}

// root is the command tree of nook.
func root() *command {
	return link(&command{
		name:    "nook",
		summary: "run commands in a remote sandbox through the sandboxd daemon",
		long: "nook is the thin client of sandboxd, the per-user daemon that owns every sandbox and every " +
			"connection to them. Run it anywhere inside a git checkout: the sandbox it means is that of the " +
			"repository root, the current branch and the nearest .rwx/sandbox.yml (or the config file given). " +
			"nook starts sandboxd in the background on first use when no daemon answers.",
		subs: []*command{
			{name: "init", args: "[file]", maxArgs: 1, argCompl: complFile, autoStart: true, run: (*app).init,
				summary: "write a sandbox config from the remote's template (default .rwx/sandbox.yml); never overwrites"},
			{name: "start", args: "[config]", maxArgs: 1, argCompl: complYAML, autoStart: true, run: (*app).start,
				summary: "start the sandbox of this checkout, branch and config (or report the active one)",
				flags:   append([]flagSpec{idFlag()}, waitFlags()...)},
			{name: "exec", args: "[config] -- CMD [ARG...]", maxArgs: 1, argv: true, argCompl: complYAML, autoStart: true, run: (*app).exec,
				summary: "run a command in the sandbox, with your changes synced both ways",
				long: "The command after -- reaches the sandbox's shell with every argument exactly as given " +
					"(spaces, quotes, $, globs and newlines are not interpreted). stdin is forwarded when it is " +
					"not a terminal (or with -i). Ctrl-C sends SIGINT to the remote command; a second Ctrl-C " +
					"within 2s disconnects, which cancels it. The exit status is the remote command's. It runs in " +
					"the sandbox's directory that corresponds to the current one (cd pkg/a && nook exec -- go test . " +
					"tests pkg/a); --root runs it at the root of the checkout.",
				flags: []flagSpec{idFlag(),
					{name: "no-sync", kind: boolFlag, help: "do not sync local changes to the sandbox and back"},
					rootFlag(),
					{name: "interactive", short: "i", kind: boolFlag, help: "forward stdin even when it is a terminal"},
					{name: "tty", short: "t", kind: boolFlag, help: "run the command on a pseudo-terminal (for full-screen and interactive programs): keys pass through raw, the window size follows"},
					{name: "reset", kind: boolFlag, help: "replace the sandbox first (stop it and start a new run, e.g. after a config change)"},
					{name: "detach", kind: boolFlag, help: "start the command and return at once, printing its id: it runs on in the sandbox (stdin empty, nothing synced back); follow it with nook attach ID (needs durable_exec)"},
				}},
			{name: "attach", args: "ID", maxArgs: 1, autoStart: true, run: (*app).attach,
				summary: "follow a command started with nook exec --detach: its output, then its exit status",
				long: "ID is what nook exec --detach printed; the command is looked up in the sandbox of this checkout " +
					"(or --id RUN). All its output kept so far comes first, then the rest as it comes; nook attach exits " +
					"with the command's own status. Ctrl-C sends SIGINT to the command; a second within 2s disconnects, " +
					"which stops it. Nothing is started: an unknown ID is an error.",
				flags: []flagSpec{idFlag()}},
			{name: "shell", args: "[config]", maxArgs: 1, argCompl: complYAML, autoStart: true, run: (*app).shell,
				summary: "open an interactive shell (yours, else bash) in the sandbox, with your changes synced both ways",
				long: "The shell runs on a pseudo-terminal with your TERM and window size (resizes follow); the local " +
					"terminal is raw while it runs, so Ctrl-C, Ctrl-D and Ctrl-Z reach the remote shell, and it is " +
					"restored however nook ends. Local changes are synced before it starts and the sandbox's changes " +
					"come back when it exits (as for exec). The exit status is the shell's. The shell is yours ($SHELL) " +
					"where the sandbox has it, else bash, else sh, started interactive (not as a login shell, whose " +
					"profile would reset the sandbox's PATH), in the sandbox's directory that corresponds to the current one.",
				flags: []flagSpec{idFlag(),
					{name: "no-sync", kind: boolFlag, help: "do not sync local changes to the sandbox and back"},
					rootFlag(),
				}},
			{name: "push", args: "[config]", maxArgs: 1, argCompl: complYAML, autoStart: true, run: (*app).push,
				summary: "sync your working tree and unpushed commits to the sandbox without running a command",
				flags:   []flagSpec{idFlag()}},
			{name: "pull", args: "[config]", maxArgs: 1, argCompl: complYAML, autoStart: true, run: (*app).pull,
				summary: "bring the sandbox's edits (by ssh, scp, background processes, shells) back into your checkout now",
				flags:   []flagSpec{idFlag()}},
			{name: "list", summary: "list sandboxes, checked against the remote", autoStart: true, run: (*app).list,
				flags: []flagSpec{{name: "all", kind: boolFlag, help: "include ended sandboxes kept as history"}}},
			{name: "status", args: "[config]", maxArgs: 1, argCompl: complYAML, autoStart: true, run: (*app).status,
				summary: "probe the sandbox of this checkout (connected, expired, no_sandbox or unknown)",
				flags:   []flagSpec{idFlag()}},
			{name: "stop", args: "[config]", maxArgs: 1, argCompl: complYAML, autoStart: true, run: (*app).stop,
				summary: "stop the sandbox of this checkout (idempotent); its edits are pulled first",
				flags:   []flagSpec{idFlag(), {name: "all", kind: boolFlag, help: "stop every sandbox"}, discardFlag()}},
			{name: "keep", args: "[config]", maxArgs: 1, argCompl: complYAML, autoStart: true, run: (*app).keep,
				summary: "pin the sandbox of this checkout so that the idle stop leaves it",
				flags:   []flagSpec{idFlag(), {name: "off", kind: boolFlag, help: "unpin it: the idle stop applies again"}}},
			{name: "prune", autoStart: true, run: (*app).prune,
				summary: "end and forget the sandboxes whose checkout is gone or whose run ended",
				flags:   []flagSpec{{name: "dry-run", kind: boolFlag, help: "list what would be pruned and change nothing"}}},
			{name: "reset", args: "[config]", maxArgs: 1, argCompl: complYAML, autoStart: true, run: (*app).reset,
				summary: "stop the sandbox of this checkout and start a new one; its edits are pulled first",
				flags:   append(waitFlags(), discardFlag())},
			bgCommand(),
			forwardCommand("forward"),
			{name: "events", summary: "follow the daemon's events", autoStart: true, run: (*app).events,
				flags: []flagSpec{{name: "since", kind: stringFlag, arg: "SEQ", help: "replay buffered events after sequence number SEQ first"}}},
			{name: "ssh-config", autoStart: true, run: (*app).sshConfig,
				summary: "print an OpenSSH config block per live sandbox (ssh, scp, rsync, git and Remote-SSH through the daemon)",
				long: "Each block names a sandbox nook-<repo>-<branch> and reaches it with ProxyCommand nook proxy --stdio %h, " +
					"with its pinned host key and its key in files the daemon writes (0600, under its state directory): " +
					"no prompt, no API call. Use: nook ssh-config > ~/.ssh/nook.config and add Include ~/.ssh/nook.config " +
					"at the top of ~/.ssh/config; run it again after nook start or reset (docs/ssh.md)."},
			{name: "proxy", args: "HOST", maxArgs: 1, autoStart: true, run: (*app).proxy,
				summary: "relay a sandbox's SSH stream on stdin and stdout (the ProxyCommand of nook ssh-config)",
				flags:   []flagSpec{{name: "stdio", kind: boolFlag, help: "relay on stdin and stdout (required)"}}},
			{name: "mcp", autoStart: true, run: (*app).mcpServe,
				summary: "serve the sandbox tools to a coding agent (Model Context Protocol on stdio)",
				long: "Register it with an agent as the command nook with the arguments [\"mcp\"] (see docs/agents.md). " +
					"Tools: exec, push, status, list, start, stop, reset, bg_start, bg_list, bg_logs, bg_restart, bg_stop. Each call names its checkout with cwd, or means " +
					"the directory the server started in (or --dir). A server started inside a checkout serves that checkout only (--checkout, --any-checkout). " +
					"The protocol is JSON already: --json changes nothing.",
				flags: []flagSpec{
					{name: "dir", kind: stringFlag, arg: "DIR", compl: complDir, help: "the checkout a tool call means when it names none (default: the current directory)"},
					{name: "max-output", kind: stringFlag, arg: "BYTES", compl: complNone, help: "the most stdout (and stderr) bytes an exec returns (default 32768)"},
					{name: "checkout", kind: stringFlag, arg: "DIR", compl: complDir, help: "confine the server to the git checkout holding DIR (default: the checkout of --dir, if it is in one)"},
					{name: "any-checkout", kind: boolFlag, help: "let calls reach every checkout on this machine (default: confined to the checkout of --dir, if it is in one)"},
				}},
			{name: "config", summary: "show the effective remote and configuration (never the token)", autoStart: true, run: (*app).config},
			{name: "version", summary: "print the versions of nook and sandboxd", autoStart: true, run: (*app).version},
			{name: "daemon", summary: "manage the sandboxd daemon",
				subs: []*command{
					{name: "status", summary: "show whether sandboxd runs, and its health (exit 3 when it does not)", run: (*app).daemonStatus},
					{name: "stop", summary: "stop sandboxd (in-flight commands finish first)", run: (*app).daemonStop},
				}},
			{name: "doctor", run: (*app).doctor,
				summary: "check the daemon, its socket, the remote, SSH to each live sandbox, clocks, git and watch limits (exit 1 when one fails)",
				long: "Each failing check says how to fix it. nook doctor never starts the daemon: without one, it says so " +
					"and skips the checks the daemon makes (the remote, SSH, clocks)."},
			{name: "help", args: "[COMMAND...]", maxArgs: 3, argCompl: complCommands, run: (*app).help,
				summary: "show help for nook or one of its commands"},
			{name: "completion", args: "SHELL", maxArgs: 1, argCompl: complValues, argValues: shells, run: (*app).completion,
				summary: "print the shell completion script for bash, zsh or fish",
				long: "bash: nook completion bash > ~/.local/share/bash-completion/completions/nook\n" +
					"zsh: nook completion zsh > ~/.zfunc/_nook (with ~/.zfunc in $fpath before compinit)\n" +
					"fish: nook completion fish > ~/.config/fish/completions/nook.fish\n" +
					"make install and the packages install all three."},
			{name: "man", summary: "print the nook(1) man page (roff) on stdout", run: (*app).man},
		},
	})
}

// rootFlag runs at the checkout's root instead of the caller's directory.
func rootFlag() flagSpec {
	return flagSpec{name: "root", kind: boolFlag, help: "run at the root of the sandbox's checkout, not in the directory that corresponds to the current one"}
}

package cli

import (
	"context"
	"errors"
	"fmt"
	"strings"
)

// flagKind is how a flag takes its value.
type flagKind int

const (
	boolFlag   flagKind = iota // --wait
	stringFlag                 // --id RUN, --id=RUN
	listFlag                   // --init k=v, repeatable
)

// complKind is what a shell completes for a positional argument or a flag's
// value.
type complKind int

const (
	complNone     complKind = iota // nothing (free text: a run id, a duration)
	complYAML                      // a sandbox config file (*.yml, *.yaml)
	complFile                      // any file
	complDir                       // a directory
	complValues                    // one of the listed values
	complCommands                  // an nook command name (for `nook help`)
)

// flagSpec describes one flag of a command.
type flagSpec struct {
	name   string // long name, without dashes
	short  string // one letter, or ""
	kind   flagKind
	arg    string // value placeholder for help ("RUN"); empty for bools
	help   string
	compl  complKind // what completes the value (stringFlag, listFlag)
	values []string  // with complValues
}

// command is one node of the command tree. Every generated artefact (help,
// `nook help`, bash/zsh/fish completions, the man page) reads these fields;
// nothing about a command is written anywhere else.
type command struct {
	name    string // one word; a subcommand's full name is its path ("daemon stop")
	summary string // one line, lower case, no final period
	long    string // optional paragraphs for `nook help CMD` and the man page
	args    string // positional synopsis, e.g. "[config]"
	maxArgs int    // positional arguments allowed before "--"
	argv    bool   // takes a command after "--"
	// argvOptional: the command after "--" may be left out (bg start of a
	// process predefined in the config).
	argvOptional bool
	// argCompl/argValues: what completes the positional arguments.
	argCompl  complKind
	argValues []string
	flags     []flagSpec
	subs      []*command // subcommands; a command with subs and no run needs one
	hidden    bool       // left out of help, completions and the man page
	autoStart bool       // start the daemon when it is not running
	run       func(*app, context.Context) int

	parent *command // set by link
}

// path is the command's full name without "nook", e.g. "daemon stop"; "" for
// the root.
func (c *command) path() string {
	if c.parent == nil {
		return ""
	}
	if c.parent.parent == nil {
		return c.name
	}
	return c.parent.path() + " " + c.name
}

// isRoot is true for the tree's root ("nook" itself).
func (c *command) isRoot() bool { return c.parent == nil }

// visible are the subcommands shown in help and completions.
func (c *command) visible() []*command {
	var out []*command
	for _, s := range c.subs {
		if !s.hidden {
			out = append(out, s)
		}
	}
	return out
}

// walk calls f on c and every command below it, depth first, in table
// order.
func (c *command) walk(f func(*command)) {
	f(c)
	for _, s := range c.subs {
		s.walk(f)
	}
}

// allFlags are the flags the command accepts: its own, then the global ones.
func (c *command) allFlags() []flagSpec {
	out := append([]flagSpec{}, c.flags...)
	out = append(out, globalFlags()...)
	if c.isRoot() {
		out = append(out, versionFlag())
	}
	return out
}

// link sets the parent pointers of the tree under root and returns root.
func link(root *command) *command {
	for _, s := range root.subs {
		s.parent = root
		link(s)
	}
	return root
}

// globalFlags are accepted by every command, before or after its name.
func globalFlags() []flagSpec {
	return []flagSpec{
		{name: "json", kind: boolFlag, help: "machine-readable output: JSON on stdout, errors as JSON objects (see docs/json.md)"},
		{name: "quiet", short: "q", kind: boolFlag, help: "no progress messages on stderr"},
		{name: "help", short: "h", kind: boolFlag, help: "show help"},
	}
}

// versionFlag is `nook --version`, the same as `nook version`.
func versionFlag() flagSpec {
	return flagSpec{name: "version", kind: boolFlag, help: "print the versions of nook and sandboxd (as `nook version`)"}
}

// parsed is a command line, split into its parts.
type parsed struct {
	cmd     *command
	bools   map[string]bool
	strings map[string]string
	lists   map[string][]string
	args    []string // positionals before "--"
	argv    []string // everything after "--"
	dashes  bool     // "--" was given
}

func (p *parsed) json() bool  { return p.bools["json"] }
func (p *parsed) help() bool  { return p.bools["help"] }
func (p *parsed) quiet() bool { return p.bools["quiet"] }

// errUsage marks a command line nook cannot run; it exits 125 with the
// command's usage.
var errUsage = errors.New("usage")

type usageError struct {
	cmd *command
	msg string
}

func (e *usageError) Error() string   { return e.msg }
func (e *usageError) Is(t error) bool { return t == errUsage }

// parse splits args (without the program name) into a command and its
// flags. The command is found by walking the tree with the words that are
// not flags; after it, flags and positionals may be interleaved until "--";
// everything after "--" is the remote command's argv, passed through
// untouched. On an error, the returned parsed still says how far the
// command was found and whether --json was given (so the error can be
// printed as JSON).
func parse(root *command, args []string) (*parsed, error) {
	p := &parsed{cmd: root, bools: map[string]bool{}, strings: map[string]string{}, lists: map[string][]string{}}
	var rest []string
	descending := true
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			rest = append(rest, args[i:]...)
			break
		}
		if descending && !strings.HasPrefix(a, "-") {
			if len(p.cmd.subs) > 0 {
				sub := p.cmd.sub(a)
				if sub == nil {
					p.scanJSON(args)
					msg := fmt.Sprintf("unknown command %q", strings.TrimSpace(p.cmd.path()+" "+a))
					if near := p.cmd.nearest(a); near != "" {
						msg += fmt.Sprintf(": did you mean %q?", near)
					}
					return p, &usageError{cmd: p.cmd, msg: msg + fmt.Sprintf(" (run `%s --help` for the list)", p.cmd.synopsisName())}
				}
				p.cmd = sub
				continue
			}
			descending = false
		}
		rest = append(rest, a)
	}
	flags := p.cmd.allFlags()
	for i := 0; i < len(rest); i++ {
		a := rest[i]
		if a == "--" {
			p.dashes = true
			p.argv = append([]string{}, rest[i+1:]...)
			break
		}
		if !strings.HasPrefix(a, "-") || a == "-" {
			p.args = append(p.args, a)
			continue
		}
		name, value, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		long := strings.HasPrefix(a, "--")
		spec := findFlag(flags, name, long)
		if spec == nil {
			p.scanJSON(args)
			return p, &usageError{cmd: p.cmd, msg: fmt.Sprintf("unknown flag %s", a)}
		}
		switch spec.kind {
		case boolFlag:
			if hasValue {
				p.scanJSON(args)
				return p, &usageError{cmd: p.cmd, msg: fmt.Sprintf("flag --%s takes no value", spec.name)}
			}
			p.bools[spec.name] = true
		case stringFlag, listFlag:
			if !hasValue {
				if i+1 >= len(rest) || rest[i+1] == "--" {
					p.scanJSON(args)
					return p, &usageError{cmd: p.cmd, msg: fmt.Sprintf("flag --%s needs a value (--%s %s)", spec.name, spec.name, spec.arg)}
				}
				i++
				value = rest[i]
			}
			if spec.kind == stringFlag {
				p.strings[spec.name] = value
			} else {
				p.lists[spec.name] = append(p.lists[spec.name], value)
			}
		}
	}
	if p.help() || p.bools["version"] {
		return p, nil
	}
	if p.cmd.run == nil {
		if p.cmd.isRoot() {
			return p, nil // bare `nook`: the caller prints the help
		}
		return p, &usageError{cmd: p.cmd, msg: fmt.Sprintf("%q needs a subcommand: run `nook help %s` for the list", p.cmd.path(), p.cmd.path())}
	}
	if len(p.args) > p.cmd.maxArgs && p.cmd.argv && len(p.argv) == 0 {
		// `nook exec ls README.md`: a command without the -- before it.
		return p, &usageError{cmd: p.cmd, msg: fmt.Sprintf("too many arguments: %s; the command goes after --: `nook %s -- %s`",
			strings.Join(p.args[p.cmd.maxArgs:], " "), p.cmd.path(), strings.Join(p.args, " "))}
	}
	if len(p.args) > p.cmd.maxArgs {
		return p, &usageError{cmd: p.cmd, msg: fmt.Sprintf("too many arguments: %s", strings.Join(p.args[p.cmd.maxArgs:], " "))}
	}
	if p.cmd.argValues != nil && len(p.args) > 0 && !contains(p.cmd.argValues, p.args[0]) {
		return p, &usageError{cmd: p.cmd, msg: fmt.Sprintf("%q is not one of %s", p.args[0], strings.Join(p.cmd.argValues, ", "))}
	}
	if p.cmd.argv && !p.cmd.argvOptional && len(p.argv) == 0 {
		return p, &usageError{cmd: p.cmd, msg: fmt.Sprintf("no command given: put it after --, for example `nook %s -- make test`", p.cmd.path())}
	}
	if !p.cmd.argv && p.dashes {
		return p, &usageError{cmd: p.cmd, msg: fmt.Sprintf("nook %s takes no command after --", p.cmd.path())}
	}
	return p, nil
}

// scanJSON sets --json when it appears before "--" even though the line
// did not parse, so that the usage error is printed as JSON.
func (p *parsed) scanJSON(args []string) {
	for _, a := range args {
		if a == "--" {
			return
		}
		if a == "--json" {
			p.bools["json"] = true
		}
	}
}

func (c *command) sub(name string) *command {
	for _, s := range c.subs {
		if s.name == name {
			return s
		}
	}
	return nil
}

// find returns the command at words below c, or nil.
func (c *command) find(words []string) *command {
	for _, w := range words {
		if c = c.sub(w); c == nil {
			return nil
		}
	}
	return c
}

// synopsisName is "nook" or "nook daemon".
func (c *command) synopsisName() string {
	if c.isRoot() {
		return "nook"
	}
	return "nook " + c.path()
}

func findFlag(flags []flagSpec, name string, long bool) *flagSpec {
	for i := range flags {
		if (long && flags[i].name == name) || (!long && flags[i].short != "" && flags[i].short == name) {
			return &flags[i]
		}
	}
	return nil
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// nearest is the subcommand of c whose name is closest to a mistyped one
// (at most two edits, a swap of neighbours counting as one), or "".
func (c *command) nearest(name string) string {
	best, bestD := "", 3
	for _, s := range c.subs {
		if s.hidden {
			continue
		}
		if d := editDistance(name, s.name); d < bestD {
			best, bestD = s.name, d
		}
	}
	return best
}

// editDistance is the optimal string alignment distance of a and b.
func editDistance(a, b string) int {
	ra, rb := []rune(a), []rune(b)
	d := make([][]int, len(ra)+1)
	for i := range d {
		d[i] = make([]int, len(rb)+1)
		d[i][0] = i
	}
	for j := range d[0] {
		d[0][j] = j
	}
	for i := 1; i <= len(ra); i++ {
		for j := 1; j <= len(rb); j++ {
			cost := 1
			if ra[i-1] == rb[j-1] {
				cost = 0
			}
			d[i][j] = min(d[i-1][j]+1, d[i][j-1]+1, d[i-1][j-1]+cost)
			if i > 1 && j > 1 && ra[i-1] == rb[j-2] && ra[i-2] == rb[j-1] {
				d[i][j] = min(d[i][j], d[i-2][j-2]+1)
			}
		}
	}
	return d[len(ra)][len(rb)]
}

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

// flagSpec describes one flag of a command.
type flagSpec struct {
	name  string // long name, without dashes
	short string // one letter, or ""
	kind  flagKind
	arg   string // value placeholder for help
	help  string
}

// command describes one sbx command for parsing and help.
type command struct {
	name      string // "daemon status" for subcommands
	args      string // positional synopsis, e.g. "[config]"
	maxArgs   int    // positional arguments allowed before "--"
	argv      bool   // takes a command after "--"
	summary   string
	flags     []flagSpec
	autoStart bool                            // start the daemon when it is not running
	run       func(*app, context.Context) int // a method of app
}

// globalFlags are accepted before or after the command name.
func globalFlags() []flagSpec {
	return []flagSpec{
		{name: "json", kind: boolFlag, help: "print machine-readable JSON on stdout"},
		{name: "help", short: "h", kind: boolFlag, help: "show help"},
	}
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

func (p *parsed) json() bool { return p.bools["json"] }
func (p *parsed) help() bool { return p.bools["help"] }

// errUsage marks a command line sbx cannot run; it exits 125 with the
// command's usage.
var errUsage = errors.New("usage")

type usageError struct {
	cmd *command
	msg string
}

func (e *usageError) Error() string   { return e.msg }
func (e *usageError) Is(t error) bool { return t == errUsage }

// parse splits args (without the program name) into a command and its
// flags. Flags and positionals may be interleaved until "--"; everything
// after "--" is the remote command's argv, passed through untouched.
func parse(cmds []*command, args []string) (*parsed, error) {
	p := &parsed{bools: map[string]bool{}, strings: map[string]string{}, lists: map[string][]string{}}
	// The command name is the first one or two words that are not flags.
	var words []string
	rest := make([]string, 0, len(args))
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			rest = append(rest, args[i:]...)
			break
		}
		if p.cmd == nil && !strings.HasPrefix(a, "-") {
			words = append(words, a)
			if c := lookup(cmds, words); c != nil {
				p.cmd = c
			} else if !isPrefix(cmds, words) {
				return nil, &usageError{msg: fmt.Sprintf("unknown command %q: run `sbx --help` for the list", strings.Join(words, " "))}
			}
			continue
		}
		rest = append(rest, a)
	}
	if p.cmd == nil && len(words) > 0 {
		return nil, &usageError{msg: fmt.Sprintf("%q needs a subcommand: run `sbx %s --help`", strings.Join(words, " "), words[0])}
	}
	flags := globalFlags()
	if p.cmd != nil {
		flags = append(globalFlags(), p.cmd.flags...)
	}
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
			return nil, &usageError{cmd: p.cmd, msg: fmt.Sprintf("unknown flag %s", a)}
		}
		switch spec.kind {
		case boolFlag:
			if hasValue {
				return nil, &usageError{cmd: p.cmd, msg: fmt.Sprintf("flag --%s takes no value", spec.name)}
			}
			p.bools[spec.name] = true
		case stringFlag, listFlag:
			if !hasValue {
				if i+1 >= len(rest) || rest[i+1] == "--" {
					return nil, &usageError{cmd: p.cmd, msg: fmt.Sprintf("flag --%s needs a value (--%s %s)", spec.name, spec.name, spec.arg)}
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
	if p.cmd == nil || p.help() {
		return p, nil
	}
	if len(p.args) > p.cmd.maxArgs {
		return nil, &usageError{cmd: p.cmd, msg: fmt.Sprintf("too many arguments: %s", strings.Join(p.args[p.cmd.maxArgs:], " "))}
	}
	if p.cmd.argv && len(p.argv) == 0 {
		return nil, &usageError{cmd: p.cmd, msg: "no command given: put it after --, for example `sbx exec -- make test`"}
	}
	if !p.cmd.argv && p.dashes {
		return nil, &usageError{cmd: p.cmd, msg: fmt.Sprintf("sbx %s takes no command after --", p.cmd.name)}
	}
	return p, nil
}

func lookup(cmds []*command, words []string) *command {
	name := strings.Join(words, " ")
	for _, c := range cmds {
		if c.name == name {
			return c
		}
	}
	return nil
}

func isPrefix(cmds []*command, words []string) bool {
	prefix := strings.Join(words, " ") + " "
	for _, c := range cmds {
		if strings.HasPrefix(c.name, prefix) {
			return true
		}
	}
	return false
}

func findFlag(flags []flagSpec, name string, long bool) *flagSpec {
	for i := range flags {
		if (long && flags[i].name == name) || (!long && flags[i].short != "" && flags[i].short == name) {
			return &flags[i]
		}
	}
	return nil
}

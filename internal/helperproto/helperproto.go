// Package helperproto is the contract between the daemon and the program
// it installs in a sandbox (sandboxd-helper, package sandboxhelper): the
// program's name and ready line, the exchange's frames and messages
// (frame.go), the native push's entries, and the path and attribute rules
// both sides apply. Both import it, so that the daemon links none of the
// helper's implementation.
package helperproto

import "strings"

// Name is the program's file name; the installed copy carries its hash.
const Name = "sandboxd-helper"

// PushEntry is one path of the pushed tree that differs from head: its
// mode and blob (Mode 0: the path is absent), with the blob's content when
// the sandbox may lack it.
type PushEntry struct {
	Path string `json:"path"`
	Mode uint32 `json:"mode"`
	OID  string `json:"oid,omitempty"`
	Data []byte `json:"data"`
}

// ConvertingAttribute is the first attribute an attributes file sets that
// can make a file in the working tree differ from its blob (line ends,
// filters, ident expansion, encodings), or that git's own conversions may
// follow (a macro of the file's own); "" when there is none. Unsetting one
// (-text, binary) converts nothing.
func ConvertingAttribute(data []byte) string {
	for _, line := range strings.Split(string(data), "\n") {
		line = strings.TrimLeft(line, " \t")
		if line == "" || line[0] == '#' {
			continue
		}
		if strings.HasPrefix(line, "[attr]") {
			return "a macro"
		}
		// The pattern, C-quoted when it holds spaces, then the attributes.
		rest := ""
		if line[0] == '"' {
			i := 1
			for i < len(line) && line[i] != '"' {
				if line[i] == '\\' {
					i++
				}
				i++
			}
			if i < len(line) {
				rest = line[i+1:]
			}
		} else if _, after, ok := strings.Cut(strings.ReplaceAll(line, "\t", " "), " "); ok {
			rest = after
		}
		for _, a := range strings.Fields(rest) {
			if strings.HasPrefix(a, "-") || strings.HasPrefix(a, "!") {
				continue
			}
			name, _, _ := strings.Cut(a, "=")
			switch name {
			case "text", "eol", "crlf", "filter", "ident", "working-tree-encoding":
				return a
			}
		}
	}
	return ""
}

// ValidPath refuses what no tree entry may be: the caller checks the
// daemon's paths before writing a file by them.
func ValidPath(p string) bool {
	if p == "" || strings.HasPrefix(p, "/") || strings.HasSuffix(p, "/") || strings.ContainsRune(p, 0) {
		return false
	}
	for _, c := range strings.Split(p, "/") {
		if c == "" || c == "." || c == ".." || strings.EqualFold(c, ".git") {
			return false
		}
	}
	return true
}

// PullHeader starts the pull's output, in the exchange's FramePull frames
// as from the pull script of the separate steps: the exec's id and the
// patch's size follow, so a truncated transfer is noticed, then the patch.
const PullHeader = "sandboxd-pull "

// Ready starts the line serve prints once it answers: "ready <instance>".
const Ready = "ready "

// ProcessKey is the name the daemon starts the helper's server under, as a
// managed process of the sandbox's agent (`rwx sandbox background list`
// shows it).
const ProcessKey = "sandboxd-helper"

// ExitNotServing is ping's exit code when no server of its binary answers
// for the checkout.
const ExitNotServing = 4

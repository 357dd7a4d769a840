package cli

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"
)

// generated returns each generated artefact of the table.
func generated(t *testing.T) map[string]string {
	t.Helper()
	r := root()
	out := map[string]string{}
	for name, f := range map[string]func(*bytes.Buffer) error{
		"bash": func(b *bytes.Buffer) error { return writeBash(b, r) },
		"zsh":  func(b *bytes.Buffer) error { return writeZsh(b, r) },
		"fish": func(b *bytes.Buffer) error { return writeFish(b, r) },
		"man":  func(b *bytes.Buffer) error { return writeMan(b, r, "v1.0.0") },
	} {
		var b bytes.Buffer
		if err := f(&b); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		out[name] = b.String()
	}
	var help bytes.Buffer
	r.walk(func(c *command) { printHelp(&help, c) })
	out["help"] = help.String()
	return out
}

// Every command and every flag of the table appears in each completion
// script, in the man page and in the help: nothing is kept by hand.
func TestGeneratedDocsCoverTable(t *testing.T) {
	docs := generated(t)
	r := root()
	n := 0
	r.walk(func(c *command) {
		if c.hidden || c.isRoot() {
			return
		}
		n++
		for doc, text := range docs {
			word := c.name
			if doc == "man" {
				word = roff("nook " + c.path())
			}
			if !hasWord(text, word) {
				t.Errorf("%s does not mention command %q", doc, c.path())
			}
			for _, f := range c.allFlags() {
				long, short := "--"+f.name, "-"+f.short
				switch doc {
				case "fish":
					long, short = "-l "+f.name, "-s "+f.short
				case "man":
					long, short = roff(long), roff(short)
				}
				if !hasWord(text, long) || (f.short != "" && !hasWord(text, short)) {
					t.Errorf("%s does not mention flag --%s of %q", doc, f.name, c.path())
				}
			}
		}
	})
	if n < 14 {
		t.Fatalf("only %d commands in the table", n)
	}
}

// hasWord reports whether w appears in text as a whole word (not inside
// a longer flag or name: "-i" is not found in "--id").
func hasWord(text, w string) bool {
	return regexp.MustCompile(`(^|[^A-Za-z0-9\\-])` + regexp.QuoteMeta(w) + `($|[^A-Za-z0-9\\-])`).MatchString(text)
}

// The bash script completes commands, subcommands, flags (-i included) and
// the values of the completion command, run by a real bash.
func TestBashCompletionCompletes(t *testing.T) {
	bash := needTool(t, "bash", "apt-get install bash")
	script := generated(t)["bash"]
	complete := func(words ...string) []string {
		t.Helper()
		prog := script + `
COMP_WORDS=("$@"); COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
_nook
printf '%s\n' "${COMPREPLY[@]}"
`
		cmd := exec.Command(bash, append([]string{"--norc", "--noprofile", "-c", prog, "bash"}, words...)...)
		cmd.Dir = t.TempDir()
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("bash: %v\n%s", err, out)
		}
		return strings.Fields(string(out))
	}
	for _, c := range []struct {
		words []string
		want  []string
	}{
		{[]string{"nook", "ex"}, []string{"exec"}},
		{[]string{"nook", "daemon", "s"}, []string{"status", "stop"}},
		{[]string{"nook", "exec", "-"}, []string{"--id", "--no-sync", "--root", "--interactive", "-i", "--tty", "-t", "--reset", "--detach", "--json", "--quiet", "-q", "--help", "-h"}},
		{[]string{"nook", "--json", "exec", "--no-sync", "--i"}, []string{"--id", "--interactive"}},
		{[]string{"nook", "completion", ""}, []string{"bash", "zsh", "fish"}},
		{[]string{"nook", "help", "da"}, []string{"daemon"}},
		{[]string{"nook", "start", "--id", ""}, nil},
		{[]string{"nook", "exec", "--", "ma"}, nil},
	} {
		if got := complete(c.words...); !reflect.DeepEqual(got, c.want) && len(got)+len(c.want) > 0 {
			t.Errorf("%q: completions %q, want %q", c.words, got, c.want)
		}
	}
}

// The man page is valid roff: man renders it without warnings.
func TestManPageRenders(t *testing.T) {
	groff := needTool(t, "groff", "apt-get install groff-base")
	cmd := exec.Command(groff, "-man", "-Tutf8", "-ww", "-z")
	cmd.Stdin = strings.NewReader(generated(t)["man"])
	out, err := cmd.CombinedOutput()
	if err != nil || len(out) > 0 {
		t.Fatalf("groff: %v\n%s", err, out)
	}
}

// Each script parses in its shell (bash -n, zsh -n, fish -n).
func TestCompletionScriptsParse(t *testing.T) {
	docs := generated(t)
	for _, c := range []struct{ shell, doc, install string }{
		{"bash", "bash", "apt-get install bash"},
		{"zsh", "zsh", "apt-get install zsh"},
		{"fish", "fish", "apt-get install fish"},
	} {
		t.Run(c.shell, func(t *testing.T) {
			sh := needTool(t, c.shell, c.install)
			path := filepath.Join(t.TempDir(), "nook."+c.shell)
			if err := os.WriteFile(path, []byte(docs[c.doc]), 0o644); err != nil {
				t.Fatal(err)
			}
			if out, err := exec.Command(sh, "-n", path).CombinedOutput(); err != nil {
				t.Fatalf("%s -n: %v\n%s", c.shell, err, out)
			}
		})
	}
}

// The fish script completes commands, subcommands, flags and values, run
// by a real fish.
func TestFishCompletionCompletes(t *testing.T) {
	fish := needTool(t, "fish", "apt-get install fish")
	path := filepath.Join(t.TempDir(), "nook.fish")
	if err := os.WriteFile(path, []byte(generated(t)["fish"]), 0o644); err != nil {
		t.Fatal(err)
	}
	complete := func(line string) []string {
		t.Helper()
		cmd := exec.Command(fish, "--no-config", "-c", "source "+path+"; complete -C '"+line+"'")
		cmd.Dir = t.TempDir()
		cmd.Env = append(os.Environ(), "HOME="+t.TempDir(), "XDG_CONFIG_HOME="+t.TempDir(), "XDG_DATA_HOME="+t.TempDir())
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("fish: %v\n%s", err, out)
		}
		var words []string
		for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			if w, _, _ := strings.Cut(l, "\t"); w != "" {
				words = append(words, w)
			}
		}
		return words
	}
	for line, want := range map[string][]string{
		"nook ex":          {"exec"},
		"nook daemon st":   {"status", "stop"},
		"nook completion ": {"bash", "fish", "zsh"},
		"nook exec --no":   {"--no-sync"},
		"nook exec -- ":    nil,
	} {
		if got := complete(line); !reflect.DeepEqual(got, want) && len(got)+len(want) > 0 {
			t.Errorf("%q: completions %q, want %q", line, got, want)
		}
	}
}

package sessions

import (
	"os/exec"
	"strings"
	"testing"
)

// TestShellQuoteRoundTripsThroughSh runs the quoted line under a real
// /bin/sh and checks that the shell sees exactly the original arguments.
func TestShellQuoteRoundTripsThroughSh(t *testing.T) {
	hostile := [][]string{
		{"echo", "hello world"},
		{"printf", "%s\n", "it's", `"double"`, "$HOME", "`id`", "$(id)", "*", "?", "[a]", "~"},
		{"a\nb", "tab\there", "", " ", "'", "''", `\`, `\\n`, "semi;colon", "pipe|x", "amp&", "<in", ">out"},
		{"ünïcødé", "日本語", "emoji🙂", "-n", "--flag=value with space"},
		{"!", "#comment", "{a,b}", "a=b", "%s%d"},
	}
	for _, argv := range hostile {
		line := shellQuote(append([]string{"printf", `%s\0`}, argv...))
		out, err := exec.Command("/bin/sh", "-c", line).Output()
		if err != nil {
			t.Fatalf("sh -c %q: %v", line, err)
		}
		got := strings.Split(strings.TrimSuffix(string(out), "\x00"), "\x00")
		if len(got) != len(argv) {
			t.Fatalf("argv %q came back as %q (line %q)", argv, got, line)
		}
		for i := range argv {
			if got[i] != argv[i] {
				t.Fatalf("arg %d: got %q, want %q (line %q)", i, got[i], argv[i], line)
			}
		}
	}
}

func TestShellQuoteLeavesPlainWordsAlone(t *testing.T) {
	if got := shellQuote([]string{"make", "-j4", "test", "GOFLAGS=-count=1", "./..."}); got != "make -j4 test GOFLAGS=-count=1 ./..." {
		t.Fatalf("got %q", got)
	}
}

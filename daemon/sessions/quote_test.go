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

// TestCommandLineSetsEnvForTheCommand: the exec request's env reaches the
// remote command byte for byte, hostile values included, and a first
// argument that looks like an assignment is still run as the command.
func TestCommandLineSetsEnvForTheCommand(t *testing.T) {
	env := map[string]string{"GREETING": "hello world", "HOSTILE": "it's $(id) `id` \"q\" ;|&\n*", "EMPTY": ""}
	line := commandLine(env, []string{"sh", "-c", `printf '%s\0' "$GREETING" "$HOSTILE" "${EMPTY-unset}"`})
	out, err := exec.Command("/bin/sh", "-c", line).Output()
	if err != nil {
		t.Fatalf("sh -c %q: %v", line, err)
	}
	got := strings.Split(strings.TrimSuffix(string(out), "\x00"), "\x00")
	if len(got) != 3 || got[0] != env["GREETING"] || got[1] != env["HOSTILE"] || got[2] != "" {
		t.Fatalf("env came through as %q (line %q)", got, line)
	}
	// Not an assignment: the shell must try to run a program named "A=b".
	out, err = exec.Command("/bin/sh", "-c", commandLine(nil, []string{"A=b"})+" 2>&1; echo \" status=$?\"").Output()
	if err != nil || !strings.Contains(string(out), "status=127") {
		t.Fatalf("argv[0] A=b: %q %v", out, err)
	}
}

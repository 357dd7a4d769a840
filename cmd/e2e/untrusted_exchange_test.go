package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// The exchange with the sandbox helper under attack by the command it
// runs, on the local remote, against the real daemon (issue 27): the
// command writes into the helper's channel through /proc, kills the
// helper, replaces its binary for the next exec. Each time the command
// runs once, the exec ends with the command's real status or says that
// it may have completed, and the laptop is untouched.

// helpersOfCheckout greps the command lines of the processes that run the
// exchanges of the checkout in $PWD: an exchange helper (by the state
// directory it names) and the relay (by its path); only its own, as the
// suite's tests run side by side as one user. The words are split so
// that the command's own line does not match.
const helpersOfCheckout = `x=exch; x="${x}ange"; y=hold; y="$y.relay"
grep -las -e "/sandboxd-helper-[^/]*.$x.-state.$PWD/.git/sandboxd." -e "^$PWD/.git/sandboxd/bin/sandboxd-helper-[^/]*.$y" /proc/[0-9]*/cmdline`

// channelAttack writes the frames of a failed push to the stdout of the
// processes that run its checkout's exchanges (their channel to the
// daemon; the command runs under the holder, not under them) and opens
// their memory; it reports what it managed to the file out.
func channelAttack(out string) string {
	return fmt.Sprintf(`F='P\000\000\000\013{"code":91}Z\000\000\000\000'
n=0
for c in $(`+helpersOfCheckout+`); do
	d=${c%%/cmdline}; n=$((n+1))
	if printf "$F" >$d/fd/1 2>/dev/null; then echo "wrote $d/fd/1" >>%[1]s; fi
	if (exec 3<$d/mem) 2>/dev/null; then echo "opened $d/mem" >>%[1]s; fi
done
echo "tried $n" >>%[1]s
`, out)
}

// frameOctal is a frame as printf's format: type, length, JSON payload.
func frameOctal(typ byte, payload string) string {
	b := append([]byte{typ, 0, 0, 0, byte(len(payload))}, payload...)
	var s strings.Builder
	for _, c := range b {
		fmt.Fprintf(&s, "\\%03o", c)
	}
	return s.String()
}

func TestUntrustedCommandAttacksTheHelpersChannel(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.writeConfig(map[string]any{"log_level": "debug"})
	d := e.startDaemon()
	repo := e.newRepo("channel", defaultConfig)
	run := e.startSandbox(repo)
	// The helper starts with the first exec; the next ones are exchanges.
	e.mustNook(repo, "exec", "--", "true")
	e.waitHelper(t, run)
	e.mustNook(repo, "exec", "--", "true")
	runs := counterFile(t, "channel")
	attack := counterFile(t, "channel-attack")
	victim := filepath.Join(e.get("HOME"), "victim.patch")
	writeFile(t, victim, "the user's own patch\n")
	l := e.snapshotLaptop(t, repo, "made.txt", "made2.txt")

	// Frames into the channel, through /proc.
	r := e.nook(repo, "exec", "--", "sh", "-c", "echo ran >>"+runs+"\necho made >made.txt\n"+channelAttack(attack)+"exit 7")
	t.Logf("channel attack: %s", r)
	got := readFile(t, attack)
	if strings.Contains(got, "wrote") || strings.Contains(got, "opened") || strings.Contains(got, "tried 0") {
		t.Errorf("the command reached its helper (or ran without one): %q", got)
	}
	if n := lines(t, runs); n != 1 || r.code != 7 {
		t.Fatalf("the command ran %d times and the exec ended %d, want once and 7: %s", n, r.code, r)
	}

	// The helper killed by its command (found by its command line): the
	// command, held, goes on; the daemon attaches to it by id and reports
	// its own status, and it is not run again.
	killHelper := `for c in $(` + helpersOfCheckout + `); do
	p=${c%/cmdline}; kill -KILL ${p#/proc/}
done
sleep 1`
	r = e.nook(repo, "exec", "--", "sh", "-c", "echo ran >>"+runs+"; echo made2 >made2.txt\n"+killHelper)
	t.Logf("helper killed: %s", r)
	if n := lines(t, runs); n != 2 {
		t.Fatalf("the commands ran %d times, want 2: %s", n, r)
	}
	if r.code != 0 || !strings.Contains(r.stderr, "helper ended while the command ran") {
		d.stop(t) // its logs are read once it ended
		t.Fatalf("an exec whose helper died was not reattached to its command (exit 0, saying so): %s\n%s", r, d.logs)
	}

	// The helper's binary replaced by the command: the next exec's answer
	// says the command started, then that nothing ran (run me again). Its
	// frames carry no tags (a script does not compute them), so the first
	// is refused; daemon/gitsync's TestReplacedHelperIsHeldToTheProtocol
	// holds a replaced helper that tags its frames to the protocol.
	fake := "#!/bin/sh\n[ \"$1\" = exchange ] || exit 2\nprintf '" +
		frameOctal('h', fmt.Sprintf(`{"version":%d}`, helperproto.Version)) + frameOctal('G', `{"snapshot":""}`) +
		frameOctal('D', `{"reason":"again","need_patch":true}`) + "'\n"
	r = e.nook(repo, "exec", "--", "sh", "-c", "echo ran >>"+runs+"\nfor b in .git/sandboxd/bin/sandboxd-helper-*; do rm -f \"$b\"; printf '%s' "+shellQuote(fake)+" >\"$b\"; chmod +x \"$b\"; done")
	if n := lines(t, runs); n != 3 || r.code != 0 {
		t.Fatalf("the replacing command: ran %d times: %s", n, r)
	}
	// A relay that was up before keeps serving from the real binary: the
	// command could kill it later, in the background; the test does it
	// for it, so that the next exec starts the replaced file.
	for _, pid := range relayPIDs(t, run) {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	r = e.nook(repo, "exec", "--", "sh", "-c", "echo ran >>"+runs)
	t.Logf("replaced helper: %s", r)
	if n := lines(t, runs); n != 3 {
		t.Fatalf("the commands ran %d times, want 3: %s", n, r)
	}
	if r.code == 0 || !strings.Contains(r.stderr, "broke the protocol") {
		t.Errorf("a replaced helper's answer was not refused: %s", r)
	}
	if got := readFile(t, victim); got != "the user's own patch\n" {
		t.Fatalf("a file outside the pulls directory was written: %q", got)
	}
	for _, f := range []string{"made.txt", "made2.txt"} {
		if _, err := os.Stat(filepath.Join(repo, f)); err != nil {
			t.Errorf("the command's edit %s did not come back: %v", f, err)
		}
	}
	l.assertUntouched(t)
}

// shellQuote is s as one word for sh.
func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

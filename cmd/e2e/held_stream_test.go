package e2e

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"
	"testing"
)

// TestHeldExecStreamsMegabytesAndStdinExactlyOnce: a held exec (kept by
// the helper's server and streamed on its socket) delivers several
// megabytes of output, every byte once and in order, with the command's
// exit code; and the caller's stdin, many stream frames of it, reaches
// the command whole, its end included. (A start that falls behind the
// server's queue: TestStreamedStartThatFallsBehindGetsTheRestFromTheFiles.)
func TestHeldExecStreamsMegabytesAndStdinExactlyOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("heldstream", defaultConfig)
	e.startServedSandbox(t, repo)
	const lines = 600000
	r := e.nook(repo, "exec", "--no-sync", "--", "sh", "-c", "seq 1 "+strconv.Itoa(lines)+"; echo done >&2; exit 3")
	if r.code != 3 {
		t.Fatalf("the held exec exited %d, want the command's 3: stderr %q", r.code, r.stderr)
	}
	var want bytes.Buffer
	for i := 1; i <= lines; i++ {
		want.WriteString(strconv.Itoa(i))
		want.WriteByte('\n')
	}
	if r.stdout != want.String() {
		t.Fatalf("stdout is %d bytes, not the command's %d, or differs", len(r.stdout), want.Len())
	}
	if !strings.Contains(r.stderr, "done\n") {
		t.Fatalf("stderr %q lacks the command's line", r.stderr)
	}
	in := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB
	sum := sha256.Sum256(in)
	r = e.nookIn(repo, bytes.NewReader(in), "exec", "--no-sync", "--", "sh", "-c", "timeout 20 sha256sum | cut -d' ' -f1")
	if r.code != 0 || strings.TrimSpace(r.stdout) != hex.EncodeToString(sum[:]) {
		t.Fatalf("the command read stdin with sum %q (exit %d, stderr %q), want %x", strings.TrimSpace(r.stdout), r.code, r.stderr, sum)
	}
}

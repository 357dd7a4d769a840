package gitsync

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// MaxFusedPatch bounds the patch that travels inside a fused exchange's
// command: the command is one exec request and, in the sandbox, one argument
// of its shell (Linux limits one argument to 128 KiB). Larger patches take
// the separate steps.
const MaxFusedPatch = 48 << 10

// Exchange is one synced exec in one remote command, so one round trip: the
// push script (its patch in a here-document), then the user's command with
// the caller's streams, then the pull script. The command's output streams
// through as it comes; what the sync has to say follows it on stdout, after
// a boundary line carrying a random nonce:
//
//	<command output> B "push 0 <snapshot>\n" "exit <code>\n" <pull output> E " <pull code>\n" <pull stderr>
//	B "push <code>\n" <push output> E "\n" <push stderr>   (the push failed; nothing ran)
//
// where B is "\x1esandboxd-<nonce>\n" and E is "\x1esandboxd-<nonce>-end".
// The pull output is the pull script's header and patch, whose size the
// header states, so the end line is found by counting, not by searching a
// patch the command wrote. A command that reads the nonce (it is in the
// script, so in its parent's argv) can forge the trailer: that lets it
// choose what comes back, which it can do by editing files anyway, and
// what comes back is checked as any pull is (refused entries, ids). It
// cannot make the command run again: once the push is done, the wrapper
// prints S ("\x1esandboxd-<nonce>-go\n", helperproto.StartMark) before
// the command starts, so it opens the stream; a report that the push
// failed is believed only when it, not S, opens the stream (nothing of the
// command's output can come first). Any other "push <code>" is the
// command's forgery: the exec ends with an error and is not run again.
//
// The wrapper shell catches HUP, INT, QUIT and TERM with a handler (never
// ignores them: the command would inherit that), so a signal to the process
// group reaches the command and the pull still runs; the wrapper then ends
// with the command's status, re-raising the signal that ended it.
type Exchange struct {
	s      *Syncer
	rp     repo
	p      *Patch
	pend   string
	nonce  string
	script string
	start  time.Time
	commit bool // the head was pushed with git's protocol first
	out    *trailerWriter
	// inst is the sandbox helper instance the exchange is for.
	inst string
}

// Fused is what a fused exchange did.
type Fused struct {
	// Ran says the user's command ran; ExitCode is then its status.
	Ran      bool
	ExitCode int
	Push     PushResult
	// Pull is the pull of the command's edits; PullErr says it failed (the
	// sandbox keeps the edits and the next exec brings them back).
	Pull    PullResult
	PullErr error
	// Native says the sandbox helper knew the working tree after the push
	// (it moved it, or adopted the tree the plain way made), so it looked
	// for the command's edits itself (see sandboxhelper).
	Native bool
	// Again says the command did not run because the push found something
	// to do first (edits of an earlier exec brought back, a commit pushed):
	// prepare and exchange again.
	Again bool
}

// errNoReport says the exchange ended before its trailer.
var errNoReport = errors.New("the sandbox's sync wrapper ended without its report")

// Fuse returns the exchange that runs command (a shell command line for the
// sandbox's /bin/sh) synced with p. ok is false when p cannot travel inside
// a command (too large, or bytes a here-document cannot carry): the caller
// then takes the separate steps (Push, the command, Pull). When the sandbox
// may lack p's head commit, it is pushed first with git's protocol (one
// more round trip, only when HEAD moved).
func (s *Syncer) Fuse(ctx context.Context, r Runner, p *Patch, command string) (*Exchange, bool, error) {
	if err := s.checkPatch(p); err != nil {
		return nil, false, err
	}
	nonce := newNonce()
	if !fusable(p.Data, nonce) {
		return nil, false, nil
	}
	rp, err := s.openRepo(ctx, p.RepoRoot)
	if err != nil {
		return nil, false, repoError(err)
	}
	// One look at the helper: the instance the exchange is for is the one
	// its script runs.
	name, inst := syncHelper(r)
	x := &Exchange{s: s, rp: rp, p: p, pend: newID(), nonce: nonce, start: time.Now(), inst: inst}
	var res PushResult
	if err := s.pushCommitsIfNeeded(ctx, r, rp, p, &res); err != nil {
		return nil, false, err
	}
	x.commit = res.Commits
	hv := helperLine(name, inst)
	bundle := ""
	switch {
	case p.lazy && hv != "":
		bundle = p.bundle
	case p.lazy:
		// The runner's helper went away since the Prepare: the separate
		// steps, which prepare the patch.
		return nil, false, nil
	case hv != "":
		// The helper's entries travel beside the patch, so the one
		// exchange takes the plain way when the helper declines.
		if entries, ok := nativeEntries(p.RepoRoot, p.recs, p.LFSFiles, MaxFusedPatch); ok {
			if b, ok := nativeBundle(entries); ok && len(b)+len(p.Data) <= MaxFusedPatch {
				bundle = b
			}
		}
	}
	x.script = fusedScript(hv, nonce, p.HeadSHA, p.Data, bundle, p.lazy, s.now(), x.pend, s.acks(rp), s.maxBytes, p.LargeTree, command)
	return x, true, nil
}

// fusable says patch can travel in a here-document ended by a line with
// nonce: under the size bound, no NUL, ending with a newline, and no line
// equal to the delimiter.
func fusable(patch []byte, nonce string) bool {
	if len(patch) == 0 {
		return true
	}
	return len(patch) <= MaxFusedPatch && patch[len(patch)-1] == '\n' &&
		bytes.IndexByte(patch, 0) < 0 && !bytes.Contains(append([]byte{'\n'}, patch...), []byte("\n"+heredocWord(nonce)+"\n"))
}

func heredocWord(nonce string) string { return "NOOK_" + nonce }

// Command is the remote command of the exchange.
func (x *Exchange) Command() string { return x.script }

// Stdout returns the writer for the exchange's standard output: the
// command's output goes to w as it arrives, the trailer is kept for Finish.
func (x *Exchange) Stdout(w io.Writer) io.Writer {
	x.out = &trailerWriter{
		w:       w,
		start:   []byte(helperproto.StartMark(x.nonce)),
		mark:    []byte(boundary(x.nonce) + "\n"),
		trailer: limitedBuffer{max: x.s.maxBytes + 64<<10, buf: &bytes.Buffer{}},
	}
	return x.out
}

// Reported says the trailer began: the push was done, and the command ran
// unless the trailer says the push failed.
func (x *Exchange) Reported() bool { return x.out != nil && x.out.found }

// Abandon passes on the command's output held back while looking for the
// trailer, for an exchange whose result nobody will take (the caller went
// away, the connection broke before the trailer): its edits stay in the
// sandbox, pending, until they are saved or the next exec brings them back.
func (x *Exchange) Abandon() {
	if x.out != nil {
		x.out.flush()
	}
}

// Finish reads the trailer once the exchange ended: it completes the push's
// bookkeeping, then applies the command's edits to the local working tree
// (or saves them) and acknowledges them. An error means the command did not
// run (the push failed); a failed pull is reported in Fused.PullErr. A
// damaged or missing pull part is fetched again with the pull script.
func (x *Exchange) Finish(ctx context.Context, r Runner) (Fused, error) {
	res := Fused{Push: PushResult{Commits: x.commit}}
	if x.out == nil || !x.out.found {
		if x.out != nil {
			x.out.flush()
		}
		return res, errdefs.Unavailable(errNoReport)
	}
	tr := x.out.trailer.buf.Bytes()
	end := []byte(boundary(x.nonce) + "-end")
	line, rest, _ := bytes.Cut(tr, []byte("\n"))
	f := strings.Fields(string(line))
	if len(f) < 2 || f[0] != "push" {
		return res, errdefs.Unavailable(fmt.Errorf("%w: it began with %q", errNoReport, clip(line)))
	}
	code, err := strconv.Atoi(f[1])
	if err != nil {
		return res, errdefs.Unavailable(fmt.Errorf("%w: it began with %q", errNoReport, clip(line)))
	}
	if code != 0 && !x.out.first {
		// The command may have run: only the report that opens the stream
		// can say it did not, and this one came after something else.
		return res, errdefs.Unavailable(newError(ErrForgedReport, nil,
			"the sandbox's answer says the push failed (exit %d) after the command had started, so the command wrote it: the command may have run and is not run again; what it changed stays in the sandbox and the next exec brings it back", code))
	}
	if code == exitNeedPatch && x.p.lazy {
		// The helper did not push: the next Prepare makes the patch.
		x.s.nativeServed(x.rp.root, "")
		res.Again = true
		return res, nil
	}
	if code != 0 {
		// Nothing ran, so nothing in the output can be forged: the end line
		// is found by searching.
		body, msg := rest, ""
		if i := bytes.Index(rest, end); i >= 0 {
			body, msg = rest[:i], string(bytes.TrimPrefix(rest[i+len(end):], []byte("\n")))
		}
		out := &limitedBuffer{max: x.s.maxBytes + 64, buf: bytes.NewBuffer(body), overflow: x.out.trailer.overflow}
		// Whether or not the local tree changed, the command has yet to run.
		if _, err := x.s.pushFailed(ctx, r, x.rp, x.p, code, out, sandboxText(msg), 0, &res.Push); err != nil {
			return res, err
		}
		res.Again = true
		return res, nil
	}
	snap := ""
	if len(f) > 2 && shaPattern.MatchString(f[2]) {
		snap = f[2]
	}
	res.Native = len(f) > 3 && f[3] == "1"
	served := ""
	if res.Native {
		served = x.inst
	}
	x.s.nativeServed(x.rp.root, served)
	x.s.pushDone(x.p, x.pend, snap, &res.Push)
	line, rest, _ = bytes.Cut(rest, []byte("\n"))
	if f := strings.Fields(string(line)); len(f) == 2 && f[0] == "exit" {
		if n, err := strconv.Atoi(f[1]); err == nil {
			res.Ran, res.ExitCode = true, n
		}
	}
	if !res.Ran {
		return res, errdefs.Unavailable(fmt.Errorf("%w: no exit status after %q", errNoReport, clip(line)))
	}
	id, patch, saved, err := x.pulled(ctx, r, rest, end)
	res.Pull, res.PullErr = x.s.land(ctx, x.rp, x.start, id, patch, saved, err)
	return res, nil
}

// pulled reads the pull part of the trailer: the pull script's output, its
// end line with the script's exit code, and its stderr. A damaged part (the
// transfer broke, or something else wrote to the exchange's stdout) is
// fetched again by running the pull script, which diffs the same snapshot.
func (x *Exchange) pulled(ctx context.Context, r Runner, rest, end []byte) (id string, patch []byte, saved string, err error) {
	body, tail, ok := splitPull(rest, end)
	if !ok || x.out.trailer.overflow {
		x.s.log.Warn("the pull part of a fused exec arrived damaged, pulling again")
		return x.s.fetchPull(ctx, r, x.rp)
	}
	line, msg, _ := bytes.Cut(tail, []byte("\n"))
	code, cerr := strconv.Atoi(strings.TrimSpace(string(line)))
	out := &limitedBuffer{max: x.s.maxBytes + 128, buf: bytes.NewBuffer(body)}
	switch {
	case cerr != nil:
		return x.s.fetchPull(ctx, r, x.rp)
	case code != 0:
		return x.s.pullFailed(ctx, r, x.rp, code, out, sandboxText(string(msg)))
	}
	return x.s.pullOutput(ctx, r, x.rp, out, 0, nil)
}

// splitPull splits the pull part at its end line, found after the size the
// pull header states: body is the pull output, tail what follows the end
// marker.
func splitPull(rest, end []byte) (body, tail []byte, ok bool) {
	n := 0
	if bytes.HasPrefix(rest, []byte(pullHeader)) {
		_, size, hok := parseHeader(rest)
		i := bytes.IndexByte(rest, '\n')
		if !hok || i < 0 {
			return nil, nil, false
		}
		n = i + 1
		if !bytes.HasPrefix(rest[n:], end) {
			// Header and patch (a patch over the limit sends the header
			// alone).
			if int64(len(rest)-n) < size {
				return nil, nil, false
			}
			n += int(size)
		}
	}
	if !bytes.HasPrefix(rest[n:], end) {
		return nil, nil, false
	}
	return rest[:n], rest[n+len(end):], true
}

func clip(b []byte) string {
	if len(b) > 80 {
		b = b[:80]
	}
	return string(b)
}

func boundary(nonce string) string { return helperproto.Boundary(nonce) }

func newNonce() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// fusedScript is the exchange's command; see Exchange. With a bundle (the
// helper's push entries, see nativeBundle) the helper's run does the push,
// the command and the pull in one process when it can, and prints the
// report (helperproto.Report); otherwise, or when it declines before the
// command, the script pushes the patch and runs the command itself. lazy
// says there is no patch: the script then ends with exitNeedPatch instead,
// before anything changed.
func fusedScript(hv, nonce, head string, patch []byte, bundle string, lazy bool, now time.Time, pend string, acks []string, max int64, large bool, command string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "N=%s\n", nonce)
	// A failure of the prelude is the push's failure.
	b.WriteString(`die() { printf '\036sandboxd-%s\npush %s\n\036sandboxd-%s-end\n' "$N" "$1" "$N"; [ -z "$2" ] || printf '%s\n' "$2"; exit 0; }` + "\n")
	b.WriteString(preludeChecks)
	b.WriteString(hv)
	b.WriteString(setupEdits)
	b.WriteString(strayEdits(acks))
	b.WriteString("ran=; pulled=; s=; snap=; ptree=; nat=\n")
	if bundle != "" {
		// Only when no earlier exec's edits wait to be brought back (the
		// plain push does that first) and no decline holds for good.
		fmt.Fprintf(&b, `off=; [ ! -f "$st/native.off" ] || read -r off <"$st/native.off" || true
p=; [ ! -f "$st/pending" ] || read -r p <"$st/pending" || true
case ' %s ' in *" $p "*) p= ;; esac
# The result file is emptied first: a run that fails before writing it
# must not be read as the last one's.
if [ -z "$p" ] && [ -n "$HI" ] && [ "$off" != "$HI %s" ] && : >"$st/run"; then
	trap : HUP INT QUIT TERM
	"$H" run -state "$st" -instance "$HI" -head %s -snap-ref "$SNAP" -base-ref "$BASE" -time %d -pending %s -path "$P0" -command %s -result "$st/run" -log "$st/native.err" -out "$st/pull.patch" -report "$N" -max %d -entries %s -- %s
	rc=$?
	# Once the push line is written the command may have run (never run
	# it again): run's status is the command's. "reported": run printed
	# the report too.
	r1=; r2=; { read -r r1; read -r r2; } <"$st/run" || true
	case "$r1" in
	"push "*) ran=1; nat=1; s=$rc; set -- $r1; snap=$2; ptree=$3; [ "$r2" != pull ] || pulled=1
		if [ "$r2" = reported ]; then
			if [ "$rc" -gt 128 ] && [ "$rc" -lt 160 ]; then trap - HUP INT QUIT TERM; kill -$((rc - 128)) $$; fi
			exit "$rc"
		fi ;;
	*) trap - HUP INT QUIT TERM
		# A signal before the push ended ends the exchange as it would
		# have ended the wrapper.
		if [ "$rc" -gt 128 ] && [ "$rc" -lt 160 ]; then kill -$((rc - 128)) $$; fi
		if [ "$rc" -eq %d ]; then off="$HI %s"; echo "$off" >"$st/native.off"; fi ;;
	esac
fi
`, strings.Join(acks, " "), head, head, now.Unix(), pend, shellWord(command), max, shellWord(bundle), strings.Join(diffOptions, " "),
			helperproto.ExitDeclinedForGood, head)
		b.WriteString("if [ -z \"$ran\" ]; then\n")
	}
	if lazy {
		// No patch for the plain way: the daemon makes one and asks again.
		fmt.Fprintf(&b, "die %d\nfi\n", exitNeedPatch)
	} else {
		plainPush(&b, nonce, head, patch, bundle != "", now, pend, acks, max, large, command)
	}
	// The pull is a function, not a subshell: one process fewer.
	fmt.Fprintf(&b, `printf '\036sandboxd-%%s\npush 0 %%s %%s\nexit %%s\n' "$N" "$snap" "$nat" "$s"
pull() {
%s}
pull 2>"$st/f.err" </dev/null
printf '\036sandboxd-%%s-end %%s\n' "$N" "$?"
[ ! -s "$st/f.err" ] || cat "$st/f.err"
if [ "$s" -gt 128 ] && [ "$s" -lt 160 ]; then trap - HUP INT QUIT TERM; kill -$((s - 128)) $$; fi
exit "$s"
`, pullBody(max, "return"))
	return b.String()
}

// plainPush writes the fused script's plain way: push the patch, run the
// command. helper says it runs only when the helper did not.
func plainPush(b *strings.Builder, nonce, head string, patch []byte, helper bool, now time.Time, pend string, acks []string, max int64, large bool, command string) {
	b.WriteString("(\n")
	b.WriteString(pushBody(head, patchKey(patch), now, pend, acks, max, large, helper))
	b.WriteString(`) >"$st/f.out" 2>"$st/f.err"`)
	if len(patch) > 0 {
		fmt.Fprintf(b, " <<'%s'\n", heredocWord(nonce))
		b.Write(patch)
		b.WriteString(heredocWord(nonce) + "\n")
	} else {
		b.WriteString(" </dev/null\n")
	}
	fmt.Fprintf(b, `pc=$?
if [ "$pc" -ne 0 ]; then
	printf '\036sandboxd-%%s\npush %%s\n' "$N" "$pc"; cat "$st/f.out"
	printf '\036sandboxd-%%s-end\n' "$N"; cat "$st/f.err"; exit 0
fi
{ read -r snap; read -r ptree; read -r nat; } <"$st/f.out" || true
trap : HUP INT QUIT TERM
printf '\036sandboxd-%%s-go\n' "$N"
PATH=$P0 sh -c %s
s=$?
`, shellWord(command))
	if helper {
		b.WriteString("fi\n")
	}
}

// trailerWriter passes a fused exchange's stdout to w up to the boundary
// mark and keeps what follows. Bytes that may begin the mark are held back
// until the next write tells. When w fails (the caller went away) it keeps
// reading: the trailer still says what became of the command's edits.
type trailerWriter struct {
	w    io.Writer
	werr error
	// start is the mark the wrapper prints before the command (see
	// Exchange); lead holds the stream's first bytes until they tell
	// whether it opens with start (then dropped), with the report's mark
	// (first), or with neither.
	start   []byte
	lead    []byte
	decided bool
	first   bool
	mark    []byte
	held    []byte
	found   bool
	trailer limitedBuffer
}

func (t *trailerWriter) Write(p []byte) (int, error) {
	n := len(p)
	if !t.decided && len(t.start) > 0 {
		t.lead = append(t.lead, p...)
		k := min(len(t.lead), len(t.start))
		if len(t.lead) < len(t.start) && bytes.Equal(t.lead, t.start[:k]) {
			return n, nil
		}
		t.decided = true
		p, t.lead = t.lead, nil
		switch {
		case bytes.HasPrefix(p, t.start):
			p = p[len(t.start):]
		case bytes.HasPrefix(p, t.mark):
			t.first = true
		}
		_, err := t.write(p)
		return n, err
	}
	return t.write(p)
}

func (t *trailerWriter) write(p []byte) (int, error) {
	n := len(p)
	if t.found {
		_, _ = t.trailer.Write(p)
		return n, nil
	}
	data := p
	if len(t.held) > 0 {
		data = append(t.held, p...)
		t.held = nil
	}
	if i := bytes.Index(data, t.mark); i >= 0 {
		t.found = true
		_, _ = t.trailer.Write(data[i+len(t.mark):])
		t.emit(data[:i])
		return n, nil
	}
	keep := partialSuffix(data, t.mark)
	if keep > 0 {
		t.held = append([]byte(nil), data[len(data)-keep:]...)
	}
	t.emit(data[:len(data)-keep])
	return n, nil
}

// flush passes on what was held back, when the mark never came.
func (t *trailerWriter) flush() {
	if !t.decided {
		t.decided = true
		t.emit(t.lead)
		t.lead = nil
	}
	held := t.held
	t.held = nil
	t.emit(held)
}

func (t *trailerWriter) emit(b []byte) {
	if len(b) == 0 || t.w == nil || t.werr != nil {
		return
	}
	_, t.werr = t.w.Write(b)
}

// partialSuffix is the length of the longest end of data that begins mark.
func partialSuffix(data, mark []byte) int {
	for k := min(len(mark)-1, len(data)); k > 0; k-- {
		if data[len(data)-k] == mark[0] && bytes.Equal(data[len(data)-k:], mark[:k]) {
			return k
		}
	}
	return 0
}

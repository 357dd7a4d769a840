package gitsync

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
)

// PushRef is the ref the local HEAD is pushed to in the sandbox: the one the
// RWX CLI uses, so both tools share what is already there.
const PushRef = "refs/rwx/sync-push"

// ReceivePackCommand is the exec request that serves git's push protocol in
// the sandbox's checkout, as `git push` over SSH sends it.
const ReceivePackCommand = "git-receive-pack '.'"

// pushCommits sends head and the commits the sandbox lacks with git's push
// protocol over one Runner call: the sandbox's git-receive-pack advertises
// its refs, this side answers with one ref update and a thin pack made by a
// local `git pack-objects` against the advertised commits it has, and reads
// the report. Only this ref changes in the sandbox; its files are untouched.
func (s *Syncer) pushCommits(ctx context.Context, r Runner, rp repo, head string) error {
	start := time.Now()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	var stderr bytes.Buffer
	type ran struct {
		code int
		err  error
	}
	done := make(chan ran, 1)
	go func() {
		code, err := r.Run(ctx, ReceivePackCommand, inR, outW, &limitedBuffer{max: 64 << 10, buf: &stderr})
		_ = outW.Close()
		_ = inR.CloseWithError(errors.New("the remote command ended"))
		done <- ran{code, err}
	}()
	// fail ends the exchange and explains what went wrong, with what the
	// sandbox said.
	fail := func(step string, err error) error {
		_ = inW.CloseWithError(err)
		cancel()
		go func() { _, _ = io.Copy(io.Discard, outR) }()
		rr := <-done
		msg := sandboxText(stderr.String())
		switch {
		case rr.err != nil && !errors.Is(rr.err, context.Canceled):
			err = fmt.Errorf("%w (%v)", err, rr.err)
		case rr.code == 127:
			return errdefs.Conflict(newError(ErrNoGit, err, "git is not installed in the sandbox, so your commits cannot be pushed to it: add a task that installs git before the sandbox task, or use --no-sync"))
		}
		if msg != "" {
			err = fmt.Errorf("%w; the sandbox said: %s", err, msg)
		}
		return errdefs.Unavailable(newError(ErrPushCommits, err, "push your commits to the sandbox (git push of %s): %s: %v; run `nook reset` if this persists, or use --no-sync", short(head), step, err))
	}
	br := bufio.NewReaderSize(outR, 64<<10)
	// The advertisement comes before anything is sent: bounded in time
	// as it is in size (readAdvertisement).
	slow := time.AfterFunc(advertTimeout, cancel)
	adv, err := readAdvertisement(br)
	if !slow.Stop() {
		err = fmt.Errorf("the sandbox's git-receive-pack did not advertise its refs within %s", advertTimeout)
	}
	if err != nil {
		return fail("read the sandbox's refs", err)
	}
	caps := adv.caps
	zero := strings.Repeat("0", len(head))
	old := zero
	if adv.pushRef != "" {
		old = adv.pushRef
	}
	var req bytes.Buffer
	if old != head {
		want := []string{"report-status"}
		for _, c := range []string{"ofs-delta", "quiet"} {
			if caps[c] {
				want = append(want, c)
			}
		}
		want = append(want, "agent=sandboxd")
		writePkt(&req, fmt.Sprintf("%s %s %s\x00%s\n", old, head, PushRef, strings.Join(want, " ")))
	}
	req.WriteString("0000")
	if _, err := inW.Write(req.Bytes()); err != nil {
		return fail("send the ref update", err)
	}
	if old == head {
		_ = inW.Close()
		drain(br, cancel)
		if rr := <-done; rr.err != nil {
			return errdefs.Unavailable(newError(ErrPushCommits, rr.err, "push your commits to the sandbox: %v", rr.err))
		}
		return nil
	}
	haves, err := s.localCommits(ctx, rp, adv.haves)
	if err != nil {
		return fail("list the commits the sandbox has", err)
	}
	var revs strings.Builder
	revs.WriteString(head + "\n")
	for _, h := range haves {
		revs.WriteString("^" + h + "\n")
	}
	args := []string{"pack-objects", "--all-progress-implied", "--revs", "--stdout", "--thin", "-q"}
	if caps["ofs-delta"] {
		args = append(args, "--delta-base-offset")
	}
	if _, err := s.run(ctx, gitCall{dir: rp.root, stdin: strings.NewReader(revs.String()), stdout: inW}, args...); err != nil {
		return fail("pack the commits", err)
	}
	_ = inW.Close()
	report, err := readPkts(br, maxReportLines)
	if err != nil {
		return fail("read the sandbox's report", err)
	}
	drain(br, cancel)
	rr := <-done
	var problems []string
	for _, l := range report {
		switch {
		case l == "unpack ok", strings.HasPrefix(l, "ok "):
		default:
			problems = append(problems, l)
		}
	}
	if len(problems) > 0 || len(report) == 0 {
		if len(report) == 0 {
			problems = append(problems, "no report")
		}
		return fail("the sandbox refused the push", errors.New(strings.Join(problems, "; ")))
	}
	if rr.err != nil {
		return errdefs.Unavailable(newError(ErrPushCommits, rr.err, "push your commits to the sandbox: %v", rr.err))
	}
	s.log.Debug("commits pushed", "head", short(head), "haves", len(haves), "took", time.Since(start))
	return nil
}

// localCommits returns the advertised commits this repository has, the
// bases of the thin pack (a commit this side lacks cannot be one).
func (s *Syncer) localCommits(ctx context.Context, rp repo, shas []string) ([]string, error) {
	seen := map[string]bool{}
	var in strings.Builder
	for _, sha := range shas {
		if !seen[sha] && shaPattern.MatchString(sha) && strings.Trim(sha, "0") != "" {
			seen[sha] = true
			in.WriteString(sha + "\n")
		}
	}
	if len(seen) == 0 {
		return nil, nil
	}
	out, err := s.run(ctx, gitCall{dir: rp.root, stdin: strings.NewReader(in.String())}, "cat-file", "--batch-check=%(objectname) %(objecttype)")
	if err != nil {
		return nil, err
	}
	var haves []string
	for _, l := range strings.Split(string(out), "\n") {
		if sha, typ, ok := strings.Cut(l, " "); ok && typ == "commit" {
			haves = append(haves, sha)
		}
	}
	return haves, nil
}

// Bounds on what git-receive-pack in the sandbox sends: its ref
// advertisement (in refs, bytes and time) and its report.
const (
	maxAdvertRefs  = 1 << 20
	maxAdvertBytes = 64 << 20
	advertTimeout  = time.Minute
	// maxHaves bounds the advertised commits offered to pack-objects as
	// the thin pack's bases: past it the pack may only be larger.
	maxHaves       = 4096
	maxReportLines = 1024
	// maxDrain bounds what is read after the report, to let the remote
	// command end on its own before it is stopped.
	maxDrain = 1 << 20
)

// advertisement is what the push needs of receive-pack's refs: the value
// of PushRef, distinct advertised ids (at most maxHaves), the
// capabilities.
type advertisement struct {
	pushRef string
	haves   []string
	caps    map[string]bool
}

// readAdvertisement reads receive-pack's ref advertisement, keeping only
// what the push needs: a sandbox can advertise any number of refs. Lines
// are read into one buffer; only what is kept becomes a string.
func readAdvertisement(br *bufio.Reader) (advertisement, error) {
	adv := advertisement{caps: map[string]bool{}}
	seen := map[string]bool{}
	buf := make([]byte, maxPkt)
	push := []byte(PushRef)
	first := true
	var total int64
	for refs := 0; ; refs++ {
		if refs > maxAdvertRefs {
			return adv, fmt.Errorf("the sandbox advertises more than %d refs: remove refs there (git for-each-ref | wc -l), or run `nook reset`", maxAdvertRefs)
		}
		line, flush, err := readPktInto(br, buf)
		if err != nil {
			return adv, err
		}
		if flush {
			return adv, nil
		}
		if total += int64(len(line)) + 4; total > maxAdvertBytes {
			return adv, fmt.Errorf("the sandbox's ref advertisement is over %s: remove refs there, or run `nook reset`", formatBytes(maxAdvertBytes))
		}
		line = bytes.TrimSuffix(line, []byte("\n"))
		if first {
			first = false
			var c []byte
			line, c, _ = bytes.Cut(line, []byte{0})
			for i, f := range strings.Fields(string(c)) {
				if i >= 64 {
					break
				}
				name, _, _ := strings.Cut(f, "=")
				adv.caps[name] = true
			}
		}
		sha, name, ok := bytes.Cut(line, []byte(" "))
		if !ok {
			return adv, fmt.Errorf("unexpected advertisement line %q", clip(line))
		}
		if len(sha) != 40 && len(sha) != 64 || !shaPattern.Match(sha) {
			continue
		}
		if bytes.Equal(name, push) {
			adv.pushRef = string(sha)
		}
		if len(adv.haves) < maxHaves && !seen[string(sha)] && string(name) != "capabilities^{}" {
			seen[string(sha)] = true
			adv.haves = append(adv.haves, string(sha))
		}
	}
}

// readPkts reads pkt-lines until a flush, at most max of them.
func readPkts(br *bufio.Reader, max int) ([]string, error) {
	var lines []string
	for {
		line, flush, err := readPkt(br)
		if err != nil {
			return lines, err
		}
		if flush {
			return lines, nil
		}
		if len(lines) >= max {
			return lines, fmt.Errorf("more than %d lines in the sandbox's answer", max)
		}
		lines = append(lines, strings.TrimSuffix(line, "\n"))
	}
}

// drain reads what follows the exchange, at most maxDrain bytes, then
// stops the remote command (stop).
func drain(br *bufio.Reader, stop func()) {
	_, _ = io.Copy(io.Discard, io.LimitReader(br, maxDrain))
	stop()
}

// maxPkt is the largest pkt-line.
const maxPkt = 65520

// readPkt reads one pkt-line; flush is true for "0000".
func readPkt(br *bufio.Reader) (string, bool, error) {
	line, flush, err := readPktInto(br, make([]byte, maxPkt))
	return string(line), flush, err
}

// readPktInto reads one pkt-line into buf (maxPkt bytes) and returns it.
func readPktInto(br *bufio.Reader, buf []byte) ([]byte, bool, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(br, hdr[:]); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return nil, false, fmt.Errorf("read a pkt-line: %w", err)
	}
	n, err := strconv.ParseUint(string(hdr[:]), 16, 16)
	if err != nil {
		return nil, false, fmt.Errorf("bad pkt-line length %q (is git installed in the sandbox?)", hdr[:])
	}
	if n == 0 {
		return nil, true, nil
	}
	if n < 4 || int(n-4) > len(buf) {
		return nil, false, fmt.Errorf("bad pkt-line length %d", n)
	}
	buf = buf[:n-4]
	if _, err := io.ReadFull(br, buf); err != nil {
		return nil, false, fmt.Errorf("read a pkt-line: %w", err)
	}
	return buf, false, nil
}

func writePkt(w *bytes.Buffer, line string) {
	fmt.Fprintf(w, "%04x%s", len(line)+4, line)
}

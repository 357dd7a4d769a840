package gitsync

import (
	"time"

	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// side is the sandbox side of a synced exec: what sync asks of the
// sandbox (look for edits made there outside an exec and bring them back,
// make the checkout the pushed tree, find the command's edits) and how it
// reaches it. sideOf picks one of its two implementations, once per exec:
//
//   - helperSide: the sandbox helper serves on the connection. The exec
//     is one exchange: an exec request of the helper speaking
//     internal/helperproto, its request carrying the scripts the helper
//     falls back to (built for it: they read what the helper found from
//     their environment).
//   - shellSide: no helper. The exec takes separate steps, each a script
//     of its own exec request (Push, the command, Pull) whose exit status
//     is that step's.
//
// Separate steps are always the shell's: a terminal exec, and an exchange
// the helper did not take (another protocol version, a decline:
// Fused.Split), take them whatever side was picked.
type side interface {
	// kind names the implementation: "helper" or "shell".
	kind() string
	// exchange is the remote command and the request of the exec of
	// command synced with in as one exchange; ok false: this side takes
	// separate steps.
	exchange(in exchangeInput, command string) (remote string, req helperproto.ExchangeRequest, ok bool)
}

// exchangeInput is what a push of an exchange says.
type exchangeInput struct {
	p    *Patch
	pend string
	acks []string
	now  time.Time
	max  int64
}

// pushScript is the helper's push script of the patch data.
func (in exchangeInput) pushScript(data []byte) string {
	p := in.p
	return prelude + pushBody(p.HeadSHA, patchKey(data), in.now, in.pend, in.acks, in.max, p.LargeTree, true)
}

// sideOf is the side of an exec on r: the helper when r offers a valid
// one (HelperRunner), else the shell.
func sideOf(r Runner) side {
	if name, inst := syncHelper(r); inst != "" {
		return helperSide{name: name, inst: inst}
	}
	return shellSide{}
}

// helperSide is the sandbox helper installed as .git/sandboxd/bin/<name>,
// its server instance inst.
type helperSide struct{ name, inst string }

func (helperSide) kind() string { return "helper" }

func (h helperSide) exchange(in exchangeInput, command string) (string, helperproto.ExchangeRequest, bool) {
	p := in.p
	req := helperproto.ExchangeRequest{
		Instance: h.inst, Head: p.HeadSHA, Time: in.now.Unix(), SnapRef: SnapshotRef, BaseRef: BaseRef,
		Pending: in.pend, Acks: in.acks, Max: in.max, DiffArgs: diffOptions, Command: command,
		StrayScript: prelude + strayEdits(in.acks, true) + `echo "${sready:--}"` + "\n",
		PullScript:  prelude + pullBody(in.max, true),
	}
	if p.early != nil {
		// The patch and its push script follow in a Patch frame
		// (Exchange.patchFrame).
		req.Entries, req.PatchFollows = []byte(p.early.bundle), true
	} else {
		if entries, ok := nativeEntries(p.RepoRoot, p.recs, p.LFSFiles, MaxFusedPatch); ok {
			if b, ok := nativeBundle(entries); ok {
				req.Entries = []byte(b)
			}
		}
		req.Patch = p.Data
		req.PushScript = in.pushScript(p.Data)
	}
	// The exec's shell finds the repository, brings in setup's files, then
	// becomes the helper (exec: no shell stays between the channel and the
	// helper), which does the rest.
	return prelude + setupEdits + h.becomeHelper(), req, true
}

// relaySetup is what an exchange's remote command does before the helper,
// for a relay that runs the helper's side in itself: it prints the sync
// state directory. It has nothing to do once one of relaySetupDone exists.
func (helperSide) relaySetup() string {
	return prelude + setupEdits + `printf '%s\n' "$st"` + "\n"
}

// relaySetupDone are paths under the git directory any of which makes
// setupEdits a no-op (the pending exec's id, or the snapshot ref).
var relaySetupDone = []string{"sandboxd/pending", SnapshotRef}

// becomeHelper is the end of an exchange's remote command: the shell
// becomes the helper. A Reattach's command is the prelude and this.
func (h helperSide) becomeHelper() string {
	return `exec "$st/bin/` + h.name + `" exchange -state "$st" -path "$P0"` + "\n"
}

// shellSide is the sandbox without a helper: POSIX shell and git.
type shellSide struct{}

func (shellSide) kind() string { return "shell" }

func (shellSide) exchange(exchangeInput, string) (string, helperproto.ExchangeRequest, bool) {
	return "", helperproto.ExchangeRequest{}, false
}

// Package sandboxhelper is the program the daemon installs in a sandbox
// (sandboxd-helper) so that a synced exec costs what the command touched,
// not what the repository holds. Its contract with the daemon is package
// internal/helperproto; a sandbox without it runs the shell scripts of
// daemon/gitsync alone, as separate steps. Each verb, and when it runs:
//
//   - serve (Serve, server.go): started by daemon/helper as a managed
//     process of the sandbox's agent (lifecycle.go): one per checkout, it
//     outlives the connection that started it and exits when asked
//     nothing for an hour, when stopped, or with the run. It tracks
//     the checkout with inotify (internal/watch.Trees) and answers, on a
//     Unix socket under .git/sandboxd/helper, one question at a time:
//     changes, adopt, push, pull (a line, a JSON body, a JSON answer).
//   - exchange (Exchange, exchange.go): one synced exec in one exec
//     request, or in the relay's process (`hold relay`, relayExchange:
//     the setup shell only when it has something to do, signals as
//     frames only), in the framed protocol of internal/helperproto (frames in
//     on stdin, frames out on stdout, which nothing else writes). It makes
//     itself non-dumpable, then does every sandbox step of the sync, each
//     natively where it can, else by the request's script (the scripts
//     never call the helper back: it hands them what it found in their
//     environment):
//     1. edits made outside an exec: a native pull against the tree the
//     last native pull left (.git/sandboxd/pulled.tree) when no earlier
//     exec's edits are pending; nothing changed ends the step, else (or
//     declined) the stray script brings them back;
//     2. the push: natively by asking the server (when the request has
//     entries, no earlier exec's edits are pending and no decline holds
//     for head, .git/sandboxd/native.off); else a stage through the server
//     (Stage, stage.go: only the paths it saw change when it can vouch for
//     the rest, git add -A otherwise), the push script, and an adopt of
//     the tree it made, so that the pull (and the next exchange) can be
//     native;
//     3. Started, the user's command with pipes of its own in a new
//     session (signals from the daemon's frames or the agent go to its
//     process group), its Exit;
//     4. the pull: natively when the server knows the tree the push left;
//     else a stage through the server and the pull script's diff.
//     The native sync (native.go) builds trees in-process
//     (internal/gitobj); it declines before changing anything when it
//     cannot vouch for the result (no known base, the tracker unsure,
//     rules files changed, converting settings or attributes,
//     submodules), and the script takes the plain way with the request's
//     patch, or, when the request says PatchFollows (the daemon sent it
//     before its git computed the patch), with the Patch frame that
//     follows it, read then and only then (readPatch; one that does not
//     come or says git failed answers PushFailed: nothing runs); a script
//     that fails answers PushFailed. Its own messages go to stderr and
//     .git/sandboxd/native.err.
//   - hold (package hold): durable execs, for a split exec without a
//     terminal when the daemon's durable exec is on (docs/durable-exec.md).
//   - ping: prints the ready line of the checkout's server when one of
//     this binary answers (ExitNotServing otherwise); the daemon finds a
//     running server with it on a new connection.
//   - version: prints the name and the binary's hash; the daemon checks an
//     upload by it.
package sandboxhelper

import (
	"crypto/rand"
	"encoding/hex"
	"path/filepath"
)

// dirName is the helper's directory under the sync state directory
// (.git/sandboxd): sockets and the tracker's marker files.
const dirName = "helper"

// maxPaths bounds the pathspecs of a restricted stage; more changed paths
// are named by their directories (collapse).
const maxPaths = 2000

// maxTracked bounds the changed paths the server remembers between two
// questions; past it the answer is "everything".
const maxTracked = 200000

// maxPathBytes bounds the command line of the restricted staging.
const maxPathBytes = 512 << 10

// socketName is the socket of server instance in the helper directory.
func socketName(instance string) string { return instance + ".sock" }

// Dir is the helper directory of a sync state directory.
func Dir(state string) string { return filepath.Join(state, dirName) }

func newInstance() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// stamp identifies one version of a file without reading it: git writes
// an index through a lock file and a rename, so any write gives a new
// inode, ctime or mtime.
type stamp struct {
	Ino   uint64 `json:"ino"`
	Size  int64  `json:"size"`
	Mtime int64  `json:"mtime"`
	Ctime int64  `json:"ctime"`
}

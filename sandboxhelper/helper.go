// Package sandboxhelper is the program the daemon installs in a sandbox
// (sandboxd-helper) so that a synced exec costs what the command touched,
// not what the repository holds.
//
// It runs twice over. `serve` lives as long as the daemon's connection (one
// exec request that never ends): it tracks the checkout's working tree with
// inotify (internal/watch.Trees) and answers, on a Unix socket under
// .git/sandboxd/helper, which paths changed since the previous question.
// `stage`, run by the sync scripts in place of `git add -A`, asks it and
// stages only those paths into the sync index; when anything is uncertain
// (no answer, a queue overflow, a new server, an ignore file changed) it
// stages the whole tree as before. `run`, in a fused exchange, has the
// server do the push and the pull itself (the native sync, native.go)
// around the user's command; `adopt` tells it the tree a plain push made,
// `pull` asks for a native pull after one. A sandbox without the helper
// runs the plain scripts.
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

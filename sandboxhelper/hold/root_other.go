//go:build !linux

package hold

// memRoot: the sandboxes are Linux; elsewhere the holder keeps its
// execs in the user's cache.
func memRoot(base, users string, uid int) (string, bool) { return "", false }

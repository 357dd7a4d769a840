//go:build !linux

package sandboxhelper

// undumpable does nothing where prctl does not exist: the daemon runs the
// helper only in Linux sandboxes.
func undumpable() {}

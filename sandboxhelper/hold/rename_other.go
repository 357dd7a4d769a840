//go:build !linux

package hold

// renameNoReplace: only Linux's rename refuses to replace an empty
// directory here; elsewhere the directory is made in place.
func renameNoReplace(oldpath, newpath string) error { return errNoReplaceUnsupported }

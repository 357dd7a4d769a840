package ipc

import "runtime/debug"

// BuildVersion is the version of the running binary as the build recorded
// it: the module version when built from a tagged module, else the VCS
// revision (with "-dirty" for a modified tree), else "devel". sandboxd and
// nook both use it (unless a -ldflags -X override sets theirs), so binaries
// built from one tree agree and `nook version` can warn when they do not.
func BuildVersion() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "devel"
	}
	if v := bi.Main.Version; v != "" && v != "(devel)" {
		return v
	}
	var rev, modified string
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			modified = s.Value
		}
	}
	if rev == "" {
		return "devel"
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	if modified == "true" {
		rev += "-dirty"
	}
	return rev
}

// Package gitversion tells whether the local git is one whose `git apply`
// has known escapes (CVE-2023-25652 class: writes outside the working tree
// through --reject, CVE-2023-23946: through a symlink), which sandboxd
// must not use on a patch from a sandbox.
package gitversion

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// fixed is, for each 2.y series that received the fix, its first fixed
// patch release; 2.41.0 and later have it, earlier series never got it.
var fixed = map[int]int{30: 9, 31: 8, 32: 7, 33: 8, 34: 8, 35: 8, 36: 6, 37: 7, 38: 5, 39: 3, 40: 1}

// Version is a git version, as `git --version` prints it.
type Version struct{ Major, Minor, Patch int }

func (v Version) String() string { return fmt.Sprintf("%d.%d.%d", v.Major, v.Minor, v.Patch) }

var versionLine = regexp.MustCompile(`^git version (\d+)\.(\d+)(?:\.(\d+))?`)

// Parse reads the first line of `git --version` ("git version 2.39.5",
// "git version 2.39.3 (Apple Git-145)", "git version 2.45.1.windows.1").
func Parse(out string) (Version, error) {
	line, _, _ := strings.Cut(strings.TrimSpace(out), "\n")
	m := versionLine.FindStringSubmatch(line)
	if m == nil {
		return Version{}, fmt.Errorf("unexpected answer from git --version: %q", clip(line))
	}
	var v Version
	v.Major, _ = strconv.Atoi(m[1])
	v.Minor, _ = strconv.Atoi(m[2])
	if m[3] != "" {
		v.Patch, _ = strconv.Atoi(m[3])
	}
	return v, nil
}

// Need says whether v's `git apply` has the known escapes; need is then
// the version to install (the fixed release of v's series, when it has
// one).
func Need(v Version) (unsafe bool, need string) {
	switch {
	case v.Major > 2 || v.Major == 2 && v.Minor >= 41:
		return false, ""
	case v.Major == 2:
		if p, ok := fixed[v.Minor]; ok {
			if v.Patch >= p {
				return false, ""
			}
			return true, fmt.Sprintf("2.%d.%d (or 2.41 and later)", v.Minor, p)
		}
	}
	return true, "2.40.1 or later (2.30.9, 2.31.8, 2.32.7, 2.33.8, 2.34.8, 2.35.8, 2.36.6, 2.37.7, 2.38.5 and 2.39.3 are fixed too)"
}

// ErrUnsafe says the git found has the known escapes.
var ErrUnsafe = errors.New("git apply has known escapes in this version")

// Check runs `git --version` (git is the binary; "" is "git") and returns
// the version, or an error saying what to install (ErrUnsafe) or that git
// does not run.
func Check(ctx context.Context, git string) (Version, error) {
	if git == "" {
		git = "git"
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, git, "--version")
	cmd.Env = append(cmd.Environ(), "LC_ALL=C")
	out, err := cmd.Output()
	if err != nil {
		return Version{}, fmt.Errorf("run %s --version: %w", git, err)
	}
	if len(out) > 4096 {
		out = out[:4096]
	}
	v, err := Parse(string(out))
	if err != nil {
		return Version{}, err
	}
	if unsafe, need := Need(v); unsafe {
		return v, fmt.Errorf("%w: git %s's `git apply` can write outside the checkout when given a crafted patch (CVE-2023-25652 and CVE-2023-23946), so sandboxd does not apply a sandbox's changes with it: install git %s", ErrUnsafe, v, need)
	}
	return v, nil
}

func clip(s string) string {
	if len(s) > 80 {
		return s[:80]
	}
	return s
}

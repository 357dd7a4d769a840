// Package userenv makes the environment of an isolated user for the
// end-to-end tests and the benchmark: a HOME, XDG directories and so a
// socket and a local remote of its own, all under one directory, with the
// built binaries first on PATH.
package userenv

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Vars creates root/home and root/run and returns the environment of a
// user living there; name signs its git commits.
func Vars(root, binDir, name string) ([]string, error) {
	home := filepath.Join(root, "home")
	rt := filepath.Join(root, "run")
	for _, d := range []string{home, rt} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("create %s: %w", d, err)
		}
	}
	return []string{
		"HOME=" + home,
		"XDG_STATE_HOME=" + filepath.Join(home, ".local/state"),
		"XDG_CONFIG_HOME=" + filepath.Join(home, ".config"),
		"XDG_DATA_HOME=" + filepath.Join(home, ".local/share"),
		"XDG_RUNTIME_DIR=" + rt,
		"PATH=" + binDir + ":" + os.Getenv("PATH"),
		"GIT_AUTHOR_NAME=" + name, "GIT_AUTHOR_EMAIL=" + name + "@example.com",
		"GIT_COMMITTER_NAME=" + name, "GIT_COMMITTER_EMAIL=" + name + "@example.com",
		"GIT_CONFIG_NOSYSTEM=1",
		"SANDBOXD_NO_AUTOSTART=1",
		"LANG=C.UTF-8",
	}, nil
}

// Get is the value of key in vars (the last one wins), "" when unset.
func Get(vars []string, key string) string {
	for i := len(vars) - 1; i >= 0; i-- {
		if k, v, _ := strings.Cut(vars[i], "="); k == key {
			return v
		}
	}
	return ""
}

// Socket is the daemon's socket of the user of vars.
func Socket(vars []string) string {
	return filepath.Join(Get(vars, "XDG_RUNTIME_DIR"), "sandboxd", "sandboxd.sock")
}

// Package paths resolves where sandboxd, sbx and sandboxd-localcloud keep
// their files, following the XDG base directory specification.
package paths

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
)

// Env looks up an environment variable; os.LookupEnv in production, a map in
// tests.
type Env func(key string) (string, bool)

// OSEnv is the process environment.
func OSEnv(key string) (string, bool) { return os.LookupEnv(key) }

// Layout is the set of locations used by sandboxd.
type Layout struct {
	Home       string
	StateDir   string // $XDG_STATE_HOME/sandboxd
	ConfigDir  string // $XDG_CONFIG_HOME/sandboxd
	DataDir    string // $XDG_DATA_HOME/sandboxd
	RuntimeDir string // $XDG_RUNTIME_DIR/sandboxd, or a per-user fallback
	Socket     string // $SANDBOXD_SOCKET, or RuntimeDir/sandboxd.sock
}

// Resolve computes the layout from env.
func Resolve(env Env) (Layout, error) {
	get := func(k string) string { v, _ := env(k); return v }
	home := get("HOME")
	if home == "" {
		h, err := os.UserHomeDir()
		if err != nil {
			return Layout{}, fmt.Errorf("resolve paths: HOME is not set: %w", err)
		}
		home = h
	}
	xdg := func(key, fallback string) string {
		if v := get(key); v != "" && filepath.IsAbs(v) {
			return v
		}
		return filepath.Join(home, fallback)
	}
	l := Layout{
		Home:      home,
		StateDir:  filepath.Join(xdg("XDG_STATE_HOME", ".local/state"), "sandboxd"),
		ConfigDir: filepath.Join(xdg("XDG_CONFIG_HOME", ".config"), "sandboxd"),
		DataDir:   filepath.Join(xdg("XDG_DATA_HOME", ".local/share"), "sandboxd"),
	}
	if rt := get("XDG_RUNTIME_DIR"); rt != "" && filepath.IsAbs(rt) {
		l.RuntimeDir = filepath.Join(rt, "sandboxd")
	} else {
		// No per-login runtime dir (cron, ssh without pam_systemd): a
		// per-user directory under the temp dir, created 0700 by the daemon.
		l.RuntimeDir = filepath.Join(os.TempDir(), "sandboxd-"+strconv.Itoa(os.Getuid()))
	}
	l.Socket = filepath.Join(l.RuntimeDir, "sandboxd.sock")
	if s := get("SANDBOXD_SOCKET"); s != "" {
		abs, err := filepath.Abs(s)
		if err != nil {
			return Layout{}, fmt.Errorf("resolve SANDBOXD_SOCKET %q: %w", s, err)
		}
		l.Socket = abs
	}
	return l, nil
}

// DatabaseFile is the bbolt session database.
func (l Layout) DatabaseFile() string { return filepath.Join(l.StateDir, "sandboxd.db") }

// LogFile is where an auto-started daemon logs.
func (l Layout) LogFile() string { return filepath.Join(l.StateDir, "sandboxd.log") }

// ConfigFile is sandboxd's own configuration file.
func (l Layout) ConfigFile() string { return filepath.Join(l.ConfigDir, "config.json") }

// LocalcloudDir is the state directory of sandboxd-localcloud.
func (l Layout) LocalcloudDir() string { return filepath.Join(l.DataDir, "localcloud") }

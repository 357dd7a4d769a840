// Package paths resolves where sandboxd, nook and sandboxd-localcloud keep
// their files, following the XDG base directory specification; on macOS,
// where the XDG variables are normally unset, the defaults are under
// ~/Library/Application Support/sandboxd (each XDG variable that is set
// still wins).
package paths

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
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

// Resolve computes the layout from env for this platform.
func Resolve(env Env) (Layout, error) { return ResolveFor(env, runtime.GOOS) }

// ResolveFor computes the layout from env for platform goos (a
// runtime.GOOS value), so that each platform's defaults can be tested on
// any.
func ResolveFor(env Env, goos string) (Layout, error) {
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
	state, config, data := ".local/state", ".config", ".local/share"
	if goos == "darwin" {
		// macOS keeps per-user application files in Application Support
		// (the state in a directory of its own, beside the config).
		support := filepath.Join("Library", "Application Support")
		state, config, data = filepath.Join(support, "sandboxd", "state"), support, support
	}
	l := Layout{
		Home:      home,
		StateDir:  filepath.Join(xdg("XDG_STATE_HOME", state), "sandboxd"),
		ConfigDir: filepath.Join(xdg("XDG_CONFIG_HOME", config), "sandboxd"),
		DataDir:   filepath.Join(xdg("XDG_DATA_HOME", data), "sandboxd"),
	}
	if goos == "darwin" && get("XDG_STATE_HOME") == "" {
		l.StateDir = filepath.Join(home, state) // not .../state/sandboxd
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

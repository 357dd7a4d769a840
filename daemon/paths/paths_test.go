package paths

import (
	"path/filepath"
	"testing"
)

func env(m map[string]string) Env {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

// Each platform's defaults, and XDG variables overriding them on both.
func TestResolvePlatformDefaults(t *testing.T) {
	home := "/home/u"
	support := filepath.Join(home, "Library", "Application Support")
	for _, c := range []struct {
		goos                   string
		vars                   map[string]string
		state, config, data, s string
	}{
		{"linux", nil, home + "/.local/state/sandboxd", home + "/.config/sandboxd", home + "/.local/share/sandboxd", ""},
		{"darwin", nil, support + "/sandboxd/state", support + "/sandboxd", support + "/sandboxd", ""},
		{"darwin", map[string]string{"XDG_STATE_HOME": "/x/state", "XDG_CONFIG_HOME": "/x/config", "XDG_DATA_HOME": "/x/data", "XDG_RUNTIME_DIR": "/x/run"},
			"/x/state/sandboxd", "/x/config/sandboxd", "/x/data/sandboxd", "/x/run/sandboxd/sandboxd.sock"},
	} {
		vars := map[string]string{"HOME": home}
		for k, v := range c.vars {
			vars[k] = v
		}
		l, err := ResolveFor(env(vars), c.goos)
		if err != nil {
			t.Fatal(err)
		}
		if l.StateDir != c.state || l.ConfigDir != c.config || l.DataDir != c.data || (c.s != "" && l.Socket != c.s) {
			t.Errorf("%s %v: state %s config %s data %s socket %s", c.goos, c.vars, l.StateDir, l.ConfigDir, l.DataDir, l.Socket)
		}
	}
}

package config

import (
	"strings"
	"testing"
	"time"
)

// TestIdleStopDefaultsPerRemoteAndParses: no idle stop on the local remote,
// DefaultRWXIdleStop on RWX Cloud, "0s" turns it off, a value below 1s is
// refused.
func TestIdleStopDefaultsPerRemoteAndParses(t *testing.T) {
	for _, tc := range []struct {
		file string
		want time.Duration
		err  string
	}{
		{`{}`, 0, ""},
		{`{"remote": "rwx"}`, DefaultRWXIdleStop, ""},
		{`{"remote": "rwx", "idle_stop": "0s"}`, 0, ""},
		{`{"idle_stop": "2h"}`, 2 * time.Hour, ""},
		{`{"idle_stop": "10ms"}`, 0, "at least 1s"},
		{`{"idle_stop": "soon"}`, 0, "Go duration"},
	} {
		l, env := testLayout(t, nil)
		writeFile(t, l.ConfigFile(), tc.file, 0o600)
		c, err := Load(l, env)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%s: want an error with %q, got %v", tc.file, tc.err, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v", tc.file, err)
		}
		if got := c.EffectiveIdleStop(); got != tc.want {
			t.Errorf("%s: idle stop %s, want %s", tc.file, got, tc.want)
		}
	}
}

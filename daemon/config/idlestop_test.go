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

// TestPullBeforeExpiryDefaultsToTwoMinutesAndParses: pulled 2m before a
// reported end by default, "0s" turns it off, below 1s is refused.
func TestPullBeforeExpiryDefaultsToTwoMinutesAndParses(t *testing.T) {
	for _, tc := range []struct {
		file string
		want time.Duration
		err  string
	}{
		{`{}`, 2 * time.Minute, ""},
		{`{"pull_before_expiry": "0s"}`, 0, ""},
		{`{"pull_before_expiry": "10m"}`, 10 * time.Minute, ""},
		{`{"pull_before_expiry": "10ms"}`, 0, "at least 1s"},
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
		if c.PullBeforeExpiry != tc.want {
			t.Errorf("%s: pull_before_expiry %s, want %s", tc.file, c.PullBeforeExpiry, tc.want)
		}
	}
}

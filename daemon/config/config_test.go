package config

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/daemon/paths"
)

// testLayout is an isolated layout with HOME and XDG_CONFIG_HOME in a temp
// dir; env holds the variables a test sets.
func testLayout(t *testing.T, env map[string]string) (paths.Layout, paths.Env) {
	t.Helper()
	home := t.TempDir()
	base := map[string]string{"HOME": home, "XDG_CONFIG_HOME": filepath.Join(home, ".config")}
	for k, v := range env {
		base[k] = v
	}
	lookup := func(k string) (string, bool) { v, ok := base[k]; return v, ok }
	l, err := paths.Resolve(lookup)
	if err != nil {
		t.Fatal(err)
	}
	return l, lookup
}

func writeFile(t *testing.T, path, content string, mode os.FileMode) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
}

func TestLoadMissingFileGivesDefaults(t *testing.T) {
	l, env := testLayout(t, nil)
	c, err := Load(l, env)
	if err != nil {
		t.Fatal(err)
	}
	want := Default()
	if !c.Equal(want) {
		t.Fatalf("got %v, want defaults %v", c, want)
	}
	if c.File != l.ConfigFile() {
		t.Errorf("File = %q, want %q", c.File, l.ConfigFile())
	}
	if c.Remote != "local" || c.RWXHost != "cloud.rwx.com" || c.IdleTimeout != 10*time.Minute ||
		c.ReconcileInterval != 30*time.Second || c.HistoryRetention != 7*24*time.Hour || !c.DurableExec {
		t.Errorf("unexpected defaults: %v", c)
	}
	if c.TokenSource() != "" || c.RWXAccessToken != "" {
		t.Errorf("no token expected, got source %q", c.TokenSource())
	}
}

func TestLoadFullFile(t *testing.T) {
	l, env := testLayout(t, nil)
	writeFile(t, l.ConfigFile(), `{
		"remote": "rwx",
		"rwx_host": "rwx.example.com",
		"rwx_access_token": " tok-file \n",
		"localcloud_binary": "/opt/bin/sandboxd-localcloud",
		"idle_timeout": "90s",
		"shutdown_timeout": "5s",
		"reconcile_interval": "1m",
		"history_retention": "48h",
		"log_level": "debug",
		"api_timeout": "2s",
		"lock_timeout": "3m",
		"ssh_probe_timeout": "2s",
		"queue_timeout": "45m", "reattach_timeout": "30s",
		"idle_stop": "45m",
		"pull_before_expiry": "5m",
		"durable_exec": false
	}`, 0o600)
	c, err := Load(l, env)
	if err != nil {
		t.Fatal(err)
	}
	want := Config{
		Remote: "rwx", RWXHost: "rwx.example.com", RWXAccessToken: "tok-file",
		LocalcloudBinary: "/opt/bin/sandboxd-localcloud", IdleTimeout: 90 * time.Second,
		ShutdownTimeout: 5 * time.Second, ReconcileInterval: time.Minute,
		HistoryRetention: 48 * time.Hour, LogLevel: slog.LevelDebug, APITimeout: 2 * time.Second,
		LockTimeout: 3 * time.Minute, SSHProbeTimeout: 2 * time.Second, QueueTimeout: 45 * time.Minute, ReattachTimeout: 30 * time.Second,
		IdleStop: 45 * time.Minute, PullBeforeExpiry: 5 * time.Minute,
	}
	if !c.Equal(want) {
		t.Fatalf("got %v, want %v", c, want)
	}
	if got, wantSrc := c.TokenSource(), "rwx_access_token in "+l.ConfigFile(); got != wantSrc {
		t.Errorf("TokenSource = %q, want %q", got, wantSrc)
	}
	if len(c.Warnings) != 0 {
		t.Errorf("unexpected warnings: %q", c.Warnings)
	}
}

func TestZeroDurationsWhereAllowed(t *testing.T) {
	l, env := testLayout(t, nil)
	writeFile(t, l.ConfigFile(), `{"idle_timeout":"0s","history_retention":"0"}`, 0o600)
	c, err := Load(l, env)
	if err != nil {
		t.Fatal(err)
	}
	if c.IdleTimeout != 0 || c.HistoryRetention != 0 {
		t.Fatalf("got idle %s retention %s, want 0 and 0", c.IdleTimeout, c.HistoryRetention)
	}
}

func TestEmptyFileIsDefaults(t *testing.T) {
	l, env := testLayout(t, nil)
	writeFile(t, l.ConfigFile(), "  \n", 0o600)
	c, err := Load(l, env)
	if err != nil {
		t.Fatal(err)
	}
	if !c.Equal(Default()) {
		t.Fatalf("got %v", c)
	}
}

func TestBrokenFiles(t *testing.T) {
	cases := []struct {
		name, content string
		want          []string // substrings of the error
	}{
		{"unknown field", `{"remote":"local","idle_timout":"1m"}`, []string{`unknown field "idle_timout"`}},
		{"syntax", "{\n  \"remote\": \"local\",\n}", []string{"invalid JSON at line 3"}},
		{"truncated", `{"remote": "local"`, []string{"ends before the object"}},
		{"wrong type", `{"remote": 3}`, []string{`field "remote"`, "string", "number"}},
		{"duration as number", `{"idle_timeout": 600}`, []string{`field "idle_timeout"`}},
		{"bad duration", `{"idle_timeout": "ten minutes"}`, []string{`field "idle_timeout"`, "ten minutes"}},
		{"negative duration", `{"shutdown_timeout": "-1s"}`, []string{`field "shutdown_timeout"`, "at least"}},
		{"zero shutdown", `{"shutdown_timeout": "0s"}`, []string{`field "shutdown_timeout"`}},
		{"reconcile too fast", `{"reconcile_interval": "30ms"}`, []string{`field "reconcile_interval"`, "at least 1s"}},
		{"unknown remote", `{"remote": "aws"}`, []string{`field "remote"`, `"aws"`, `"local"`, `"rwx"`}},
		{"empty host", `{"rwx_host": " "}`, []string{`"rwx_host" is empty`}},
		{"relative binary", `{"localcloud_binary": "bin/lc"}`, []string{"absolute path"}},
		{"relative helper", `{"sync_helper": "bin/helper"}`, []string{`field "sync_helper"`, `"on"`, `"off"`, "absolute path"}},
		{"bad log level", `{"log_level": "loud"}`, []string{`field "log_level"`, "loud"}},
		{"array", `[]`, []string{"want a JSON object"}},
		{"trailing data", `{} {}`, []string{"after the JSON object"}},
		{"every problem", `{"remote": "aws", "idle_timeout": "ten", "log_level": 3, "colour": "red", "size": 1}`,
			[]string{"4 problems", `field "remote"`, `field "idle_timeout"`, `field "log_level"`, `unknown fields "colour", "size"`}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			l, env := testLayout(t, nil)
			writeFile(t, l.ConfigFile(), tc.content, 0o600)
			_, err := Load(l, env)
			if err == nil {
				t.Fatal("Load succeeded on a broken file")
			}
			msg := err.Error()
			for _, w := range append(tc.want, l.ConfigFile()) {
				if !strings.Contains(msg, w) {
					t.Errorf("error %q does not mention %q", msg, w)
				}
			}
		})
	}
}

func TestUnreadableFile(t *testing.T) {
	if os.Getuid() == 0 {
		// root reads anything; use a directory in the file's place instead.
		l, env := testLayout(t, nil)
		if err := os.MkdirAll(l.ConfigFile(), 0o700); err != nil {
			t.Fatal(err)
		}
		if _, err := Load(l, env); err == nil || !strings.Contains(err.Error(), l.ConfigFile()) {
			t.Fatalf("want an error naming %s, got %v", l.ConfigFile(), err)
		}
		return
	}
	l, env := testLayout(t, nil)
	writeFile(t, l.ConfigFile(), `{}`, 0o000)
	if _, err := Load(l, env); err == nil || !strings.Contains(err.Error(), l.ConfigFile()) {
		t.Fatalf("want an error naming %s, got %v", l.ConfigFile(), err)
	}
}

func TestEnvironmentOverridesFile(t *testing.T) {
	l, env := testLayout(t, map[string]string{
		"SANDBOXD_REMOTE":  "rwx",
		"RWX_HOST":         "staging.rwx.example",
		"RWX_ACCESS_TOKEN": "tok-env",
	})
	writeFile(t, l.ConfigFile(), `{"remote":"local","rwx_host":"file.example","rwx_access_token":"tok-file"}`, 0o600)
	writeFile(t, filepath.Join(l.Home, ".config/rwx/accesstoken"), "tok-cli\n", 0o600)
	c, err := Load(l, env)
	if err != nil {
		t.Fatal(err)
	}
	if c.Remote != "rwx" || c.RWXHost != "staging.rwx.example" || c.RWXAccessToken != "tok-env" {
		t.Fatalf("env did not override: %v", c)
	}
	if c.TokenSource() != "RWX_ACCESS_TOKEN environment variable" {
		t.Errorf("TokenSource = %q", c.TokenSource())
	}
}

func TestBadRemoteInEnvironment(t *testing.T) {
	l, env := testLayout(t, map[string]string{"SANDBOXD_REMOTE": "cloud"})
	_, err := Load(l, env)
	if err == nil || !strings.Contains(err.Error(), "SANDBOXD_REMOTE") || !strings.Contains(err.Error(), `"cloud"`) {
		t.Fatalf("want an error naming SANDBOXD_REMOTE and the value, got %v", err)
	}
}

func TestRWXCLITokenFileFallback(t *testing.T) {
	t.Run("config/rwx", func(t *testing.T) {
		l, env := testLayout(t, nil)
		p := filepath.Join(l.Home, ".config", "rwx", "accesstoken")
		writeFile(t, p, "  tok-cli\n", 0o600)
		// The CLI's file sits at ~/.config/rwx even when XDG_CONFIG_HOME
		// points elsewhere: it does not follow XDG.
		c, err := Load(l, env)
		if err != nil {
			t.Fatal(err)
		}
		if c.RWXAccessToken != "tok-cli" || c.TokenSource() != "RWX CLI token file "+p {
			t.Fatalf("token %q from %q", c.RWXAccessToken, c.TokenSource())
		}
	})
	t.Run("legacy mint", func(t *testing.T) {
		l, env := testLayout(t, nil)
		p := filepath.Join(l.Home, ".mint", "accesstoken")
		writeFile(t, p, "tok-mint", 0o600)
		c, err := Load(l, env)
		if err != nil {
			t.Fatal(err)
		}
		if c.RWXAccessToken != "tok-mint" || c.TokenSource() != "RWX CLI token file "+p {
			t.Fatalf("token %q from %q", c.RWXAccessToken, c.TokenSource())
		}
	})
	t.Run("file beats CLI token", func(t *testing.T) {
		l, env := testLayout(t, nil)
		writeFile(t, filepath.Join(l.Home, ".config", "rwx", "accesstoken"), "tok-cli", 0o600)
		writeFile(t, l.ConfigFile(), `{"rwx_access_token":"tok-file"}`, 0o600)
		c, err := Load(l, env)
		if err != nil {
			t.Fatal(err)
		}
		if c.RWXAccessToken != "tok-file" {
			t.Fatalf("token %q from %q", c.RWXAccessToken, c.TokenSource())
		}
	})
	t.Run("unreadable token file", func(t *testing.T) {
		l, env := testLayout(t, nil)
		// A directory where the file should be: unreadable for anyone.
		if err := os.MkdirAll(filepath.Join(l.Home, ".config", "rwx", "accesstoken"), 0o700); err != nil {
			t.Fatal(err)
		}
		c, err := Load(l, env)
		if err != nil {
			t.Fatalf("local remote must not need the token: %v", err)
		}
		if len(c.Warnings) != 1 || !strings.Contains(c.Warnings[0], "accesstoken") {
			t.Errorf("want one warning about the token file, got %q", c.Warnings)
		}
		writeFile(t, l.ConfigFile(), `{"remote":"rwx"}`, 0o600)
		if _, err := Load(l, env); err == nil || !strings.Contains(err.Error(), "accesstoken") {
			t.Fatalf("rwx remote with an unreadable token file: want an error naming it, got %v", err)
		}
	})
}

func TestTokenNeverPrinted(t *testing.T) {
	l, env := testLayout(t, map[string]string{"RWX_ACCESS_TOKEN": "s3cr3t-token"})
	c, err := Load(l, env)
	if err != nil {
		t.Fatal(err)
	}
	var sb strings.Builder
	slog.New(slog.NewTextHandler(&sb, nil)).Info("loaded", "config", c)
	for _, s := range []string{sb.String(), fmt.Sprint(c), fmt.Sprintf("%+v", c), fmt.Sprintf("%#v", c), c.TokenSource()} {
		if strings.Contains(s, "s3cr3t") {
			t.Fatalf("token printed: %s", s)
		}
	}
	if !strings.Contains(sb.String(), "RWX_ACCESS_TOKEN environment variable") {
		t.Errorf("log should name the token's source: %s", sb.String())
	}
}

func TestWorldReadableTokenWarns(t *testing.T) {
	l, env := testLayout(t, nil)
	writeFile(t, l.ConfigFile(), `{"rwx_access_token":"tok"}`, 0o644)
	c, err := Load(l, env)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Warnings) != 1 || !strings.Contains(c.Warnings[0], "chmod 600") {
		t.Fatalf("want a chmod warning, got %q", c.Warnings)
	}
}

func TestParseLogLevel(t *testing.T) {
	for in, want := range map[string]slog.Level{"debug": slog.LevelDebug, "INFO": slog.LevelInfo, "warn": slog.LevelWarn, "warning": slog.LevelWarn, " error ": slog.LevelError} {
		got, err := ParseLogLevel(in)
		if err != nil || got != want {
			t.Errorf("ParseLogLevel(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	if _, err := ParseLogLevel("trace"); err == nil {
		t.Error("trace accepted")
	}
}

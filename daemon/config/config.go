// Package config loads sandboxd's own configuration: the JSON file at
// $XDG_CONFIG_HOME/sandboxd/config.json, overridden by a few environment
// variables, with the RWX CLI's access token file as the last fallback for
// the RWX Cloud token.
package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/sandboxd/sandboxd/daemon/paths"
)

// Remote kinds.
const (
	RemoteLocal = "local" // the embedded sandboxd-localcloud (default)
	RemoteRWX   = "rwx"   // RWX Cloud
)

// Defaults.
const (
	DefaultRemote            = RemoteLocal
	DefaultRWXHost           = "cloud.rwx.com"
	DefaultIdleTimeout       = 10 * time.Minute
	DefaultShutdownTimeout   = 30 * time.Second
	DefaultReconcileInterval = 30 * time.Second
	DefaultHistoryRetention  = 7 * 24 * time.Hour
	DefaultAPITimeout        = 30 * time.Second
	DefaultLockTimeout       = 10 * time.Minute
	DefaultSSHProbeTimeout   = 5 * time.Second
	DefaultQueueTimeout      = time.Hour
	DefaultReattachTimeout   = 2 * time.Minute
	DefaultLogLevel          = slog.LevelInfo
	// DefaultRWXIdleStop is idle_stop on RWX Cloud when the file says
	// nothing (docs/daemon.md says why); the local remote has none.
	DefaultRWXIdleStop = 30 * time.Minute
	// DefaultPullBeforeExpiry is how long before a remote-reported end of
	// a run its sandbox's edits are pulled.
	DefaultPullBeforeExpiry = 2 * time.Minute
)

// IdleStopAuto is Config.IdleStop when the file does not set idle_stop: the
// remote's default applies (EffectiveIdleStop).
const IdleStopAuto time.Duration = -1

// Environment variables that override the file.
const (
	EnvRemote = "SANDBOXD_REMOTE"
	EnvHost   = "RWX_HOST"
	EnvToken  = "RWX_ACCESS_TOKEN"
)

// minReconcileInterval keeps a typo ("30ms") from hammering the remote API.
const minReconcileInterval = time.Second

// sync_helper's words: SyncHelperOff installs no helper in sandboxes,
// SyncHelperOn the one next to sandboxd (the default, on every remote).
const (
	SyncHelperOff = "off"
	SyncHelperOn  = "on"
)

// Config is the effective configuration of sandboxd.
type Config struct {
	// Remote is RemoteLocal or RemoteRWX.
	Remote string
	// RWXHost is the RWX Cloud host (RWX_HOST form: a host name, or a URL).
	RWXHost string
	// RWXAccessToken authenticates against RWX Cloud. Never log it; the
	// LogValue and String methods leave it out.
	RWXAccessToken string
	// LocalcloudBinary is the sandboxd-localcloud executable to start for
	// the local remote; empty means "next to sandboxd, else on PATH".
	LocalcloudBinary string
	// SyncHelper is the sandboxd-helper executable installed in Linux
	// sandboxes of this machine's architecture to sync in proportion to
	// what changed: a path, SyncHelperOn (the one next to sandboxd),
	// SyncHelperOff, or empty (as SyncHelperOn).
	SyncHelper string
	// IdleTimeout is how long a socket-activated daemon with nothing live
	// waits before exiting; 0 disables idle exit.
	IdleTimeout time.Duration
	// ShutdownTimeout bounds the graceful part of a shutdown.
	ShutdownTimeout time.Duration
	// ReconcileInterval is the period of the reconcile loop.
	ReconcileInterval time.Duration
	// HistoryRetention is how long ended sessions are kept for `nook list
	// --all`; 0 keeps them forever.
	HistoryRetention time.Duration
	// LogLevel is the minimum level logged.
	LogLevel slog.Level
	// APITimeout bounds each call to the remote's runs API.
	APITimeout time.Duration
	// LockTimeout bounds an exec's wait for the sandbox agent's lock.
	LockTimeout time.Duration
	// SSHProbeTimeout is how long a connection may leave a keepalive
	// unanswered, while an exec waits on it, before it is replaced.
	SSHProbeTimeout time.Duration
	// QueueTimeout bounds an exec's wait for its turn in the sandbox's
	// queue.
	QueueTimeout time.Duration
	// ReattachTimeout bounds how long a held command whose connection was
	// lost waits for a new one to reattach.
	ReattachTimeout time.Duration
	// DurableExec runs commands under the sandbox helper's holder, so
	// that they survive a lost connection (docs/durable-exec.md); on by
	// default, "durable_exec": false turns it off.
	DurableExec bool
	// IdleStop stops a sandbox nobody used for that long (0: never;
	// IdleStopAuto: the remote's default, see EffectiveIdleStop).
	IdleStop time.Duration
	// PullBeforeExpiry is how long before the end a remote reports for a
	// run (expires_at) the sandbox's edits are pulled (0: never).
	PullBeforeExpiry time.Duration

	// File is the config file this was loaded from (it may not exist).
	File string
	// Warnings are non-fatal problems found while loading (for example a
	// token in a file other users can read); the daemon logs them.
	Warnings []string

	tokenSource string
}

// Default returns the configuration used when no file and no environment
// variable says otherwise.
func Default() Config {
	return Config{
		Remote:            DefaultRemote,
		RWXHost:           DefaultRWXHost,
		IdleTimeout:       DefaultIdleTimeout,
		ShutdownTimeout:   DefaultShutdownTimeout,
		ReconcileInterval: DefaultReconcileInterval,
		HistoryRetention:  DefaultHistoryRetention,
		LogLevel:          DefaultLogLevel,
		APITimeout:        DefaultAPITimeout,
		LockTimeout:       DefaultLockTimeout,
		SSHProbeTimeout:   DefaultSSHProbeTimeout,
		QueueTimeout:      DefaultQueueTimeout,
		ReattachTimeout:   DefaultReattachTimeout,
		IdleStop:          IdleStopAuto,
		PullBeforeExpiry:  DefaultPullBeforeExpiry,
		DurableExec:       true,
	}
}

// EffectiveIdleStop is the idle stop in force: the configured one, else
// none on the local remote (its sandboxes cost nothing idle) and
// DefaultRWXIdleStop on RWX Cloud.
func (c Config) EffectiveIdleStop() time.Duration {
	switch {
	case c.IdleStop >= 0:
		return c.IdleStop
	case c.Remote == RemoteRWX:
		return DefaultRWXIdleStop
	}
	return 0
}

// TokenSource says where RWXAccessToken came from, never the token itself:
// "RWX_ACCESS_TOKEN environment variable", "rwx_access_token in <file>",
// "RWX CLI token file <file>", or "" when there is no token.
func (c Config) TokenSource() string { return c.tokenSource }

// Equal reports whether two configurations have the same settings (File,
// Warnings and the token's source aside).
func (c Config) Equal(o Config) bool {
	return c.Remote == o.Remote && c.RWXHost == o.RWXHost && c.RWXAccessToken == o.RWXAccessToken &&
		c.LocalcloudBinary == o.LocalcloudBinary && c.SyncHelper == o.SyncHelper && c.IdleTimeout == o.IdleTimeout &&
		c.ShutdownTimeout == o.ShutdownTimeout && c.ReconcileInterval == o.ReconcileInterval &&
		c.HistoryRetention == o.HistoryRetention && c.LogLevel == o.LogLevel && c.APITimeout == o.APITimeout &&
		c.LockTimeout == o.LockTimeout && c.SSHProbeTimeout == o.SSHProbeTimeout &&
		c.QueueTimeout == o.QueueTimeout && c.ReattachTimeout == o.ReattachTimeout && c.DurableExec == o.DurableExec &&
		c.IdleStop == o.IdleStop && c.PullBeforeExpiry == o.PullBeforeExpiry
}

// LogValue makes the configuration safe to log: the token is left out.
func (c Config) LogValue() slog.Value {
	return slog.GroupValue(
		slog.String("file", c.File),
		slog.String("remote", c.Remote),
		slog.String("rwx_host", c.RWXHost),
		slog.String("token_source", c.tokenSource),
		slog.String("localcloud_binary", c.LocalcloudBinary),
		slog.String("sync_helper", c.SyncHelper),
		slog.Duration("idle_timeout", c.IdleTimeout),
		slog.Duration("shutdown_timeout", c.ShutdownTimeout),
		slog.Duration("reconcile_interval", c.ReconcileInterval),
		slog.Duration("history_retention", c.HistoryRetention),
		slog.String("log_level", c.LogLevel.String()),
		slog.Duration("api_timeout", c.APITimeout),
		slog.Duration("lock_timeout", c.LockTimeout),
		slog.Duration("ssh_probe_timeout", c.SSHProbeTimeout),
		slog.Duration("queue_timeout", c.QueueTimeout),
		slog.Duration("reattach_timeout", c.ReattachTimeout),
		slog.Bool("durable_exec", c.DurableExec),
		slog.Duration("idle_stop", c.EffectiveIdleStop()),
		slog.Duration("pull_before_expiry", c.PullBeforeExpiry),
	)
}

// String is the LogValue in text form, so that printing a Config with %v
// never shows the token either.
func (c Config) String() string { return c.LogValue().String() }

// GoString keeps %#v from printing the token.
func (c Config) GoString() string { return "config.Config" + c.String() }

// file is the on-disk form. Pointers tell "absent" from "empty".
type file struct {
	Remote            *string `json:"remote"`
	RWXHost           *string `json:"rwx_host"`
	RWXAccessToken    *string `json:"rwx_access_token"`
	LocalcloudBinary  *string `json:"localcloud_binary"`
	SyncHelper        *string `json:"sync_helper"`
	IdleTimeout       *string `json:"idle_timeout"`
	ShutdownTimeout   *string `json:"shutdown_timeout"`
	ReconcileInterval *string `json:"reconcile_interval"`
	HistoryRetention  *string `json:"history_retention"`
	LogLevel          *string `json:"log_level"`
	APITimeout        *string `json:"api_timeout"`
	LockTimeout       *string `json:"lock_timeout"`
	SSHProbeTimeout   *string `json:"ssh_probe_timeout"`
	QueueTimeout      *string `json:"queue_timeout"`
	ReattachTimeout   *string `json:"reattach_timeout"`
	DurableExec       *bool   `json:"durable_exec"`
	IdleStop          *string `json:"idle_stop"`
	PullBeforeExpiry  *string `json:"pull_before_expiry"`
}

// Load reads the configuration: defaults, then the config file
// (layout.ConfigFile(); a missing file means defaults), then the
// environment overrides, then the RWX CLI token file when no token was
// given otherwise. Any problem in the file is an error naming the file.
func Load(layout paths.Layout, env paths.Env) (Config, error) {
	if env == nil {
		env = paths.OSEnv
	}
	c := Default()
	c.File = layout.ConfigFile()

	raw, err := os.ReadFile(c.File)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		// No file: defaults.
	case err != nil:
		return Config{}, fmt.Errorf("read sandboxd config %s: %w", c.File, err)
	default:
		if err := c.apply(raw); err != nil {
			return Config{}, fmt.Errorf("sandboxd config %s: %w; fix the file or move it away to use the defaults", c.File, err)
		}
	}

	if v, ok := env(EnvRemote); ok && v != "" {
		if err := checkRemote(v); err != nil {
			return Config{}, fmt.Errorf("%s: %w", EnvRemote, err)
		}
		c.Remote = v
	}
	if v, ok := env(EnvHost); ok && v != "" {
		c.RWXHost = v
	}
	if v, ok := env(EnvToken); ok && v != "" {
		c.RWXAccessToken, c.tokenSource = strings.TrimSpace(v), EnvToken+" environment variable"
	}
	if c.RWXAccessToken == "" {
		tok, src, err := rwxCLIToken(layout.Home)
		switch {
		case err != nil && c.Remote == RemoteRWX:
			return Config{}, err
		case err != nil:
			// Only RWX Cloud needs the token; a broken token file must not
			// stop the local remote from working.
			c.Warnings = append(c.Warnings, err.Error())
		case tok != "":
			c.RWXAccessToken, c.tokenSource = tok, src
		}
	}
	return c, nil
}

// apply decodes a config file over c, strictly, reporting every problem
// it finds (not only the first), joined.
func (c *Config) apply(raw []byte) error {
	if len(bytes.TrimSpace(raw)) == 0 {
		return nil // an empty file is an empty object
	}
	var obj map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(raw))
	if err := dec.Decode(&obj); err != nil {
		return describeDecodeError(raw, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("unexpected data after the JSON object")
	}
	if obj == nil {
		return errors.New("want a JSON object, got a JSON null")
	}
	var f file
	fields := f.fields()
	var errs []error
	var unknown []string
	keys := make([]string, 0, len(obj))
	for k := range obj {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if strings.EqualFold(k, "durable_exec") {
			if err := json.Unmarshal(obj[k], &f.DurableExec); err != nil {
				errs = append(errs, fmt.Errorf("field %q: want true or false", k))
			}
			continue
		}
		dst := fieldFor(fields, k)
		if dst == nil {
			unknown = append(unknown, strconv.Quote(k))
			continue
		}
		var v *string
		if err := json.Unmarshal(obj[k], &v); err != nil {
			var typ *json.UnmarshalTypeError
			if errors.As(err, &typ) {
				errs = append(errs, fmt.Errorf("field %q: want a string, got a JSON %s", k, typ.Value))
			} else {
				errs = append(errs, fmt.Errorf("field %q: %w", k, err))
			}
			continue
		}
		*dst = v
	}
	if len(unknown) > 0 {
		word := "field"
		if len(unknown) > 1 {
			word = "fields"
		}
		errs = append(errs, fmt.Errorf("unknown %s %s; known fields: %s", word, strings.Join(unknown, ", "), strings.Join(fieldNames(), ", ")))
	}

	if f.Remote != nil {
		if err := checkRemote(*f.Remote); err != nil {
			errs = append(errs, fmt.Errorf("field \"remote\": %w", err))
		} else {
			c.Remote = *f.Remote
		}
	}
	if f.RWXHost != nil {
		if strings.TrimSpace(*f.RWXHost) == "" {
			errs = append(errs, errors.New("field \"rwx_host\" is empty; remove it to use "+DefaultRWXHost))
		} else {
			c.RWXHost = *f.RWXHost
		}
	}
	if f.RWXAccessToken != nil && *f.RWXAccessToken != "" {
		c.RWXAccessToken = strings.TrimSpace(*f.RWXAccessToken)
		c.tokenSource = "rwx_access_token in " + c.File
		if fi, err := os.Stat(c.File); err == nil && fi.Mode().Perm()&0o077 != 0 {
			c.Warnings = append(c.Warnings, fmt.Sprintf("%s holds an access token and is readable by other users (mode %04o); run chmod 600 %s", c.File, fi.Mode().Perm(), c.File))
		}
	}
	if f.DurableExec != nil {
		c.DurableExec = *f.DurableExec
	}
	if f.SyncHelper != nil {
		c.SyncHelper = *f.SyncHelper
		if c.SyncHelper != "" && c.SyncHelper != SyncHelperOff && c.SyncHelper != SyncHelperOn && !filepath.IsAbs(c.SyncHelper) {
			errs = append(errs, fmt.Errorf("field \"sync_helper\" must be %q, %q or an absolute path, got %q", SyncHelperOn, SyncHelperOff, c.SyncHelper))
		}
	}
	if f.LocalcloudBinary != nil {
		c.LocalcloudBinary = *f.LocalcloudBinary
		if c.LocalcloudBinary != "" && !filepath.IsAbs(c.LocalcloudBinary) {
			errs = append(errs, fmt.Errorf("field \"localcloud_binary\" must be an absolute path, got %q", c.LocalcloudBinary))
		}
	}
	durations := []struct {
		name string
		src  *string
		dst  *time.Duration
		min  time.Duration
		zero string // meaning of 0, or "" when 0 is not allowed
	}{
		{"idle_timeout", f.IdleTimeout, &c.IdleTimeout, 0, "never exit when idle"},
		{"shutdown_timeout", f.ShutdownTimeout, &c.ShutdownTimeout, time.Millisecond, ""},
		{"reconcile_interval", f.ReconcileInterval, &c.ReconcileInterval, minReconcileInterval, ""},
		{"history_retention", f.HistoryRetention, &c.HistoryRetention, 0, "keep forever"},
		{"api_timeout", f.APITimeout, &c.APITimeout, 100 * time.Millisecond, ""},
		{"lock_timeout", f.LockTimeout, &c.LockTimeout, 100 * time.Millisecond, ""},
		{"ssh_probe_timeout", f.SSHProbeTimeout, &c.SSHProbeTimeout, 10 * time.Millisecond, ""},
		{"queue_timeout", f.QueueTimeout, &c.QueueTimeout, 100 * time.Millisecond, ""},
		{"reattach_timeout", f.ReattachTimeout, &c.ReattachTimeout, 100 * time.Millisecond, ""},
		{"idle_stop", f.IdleStop, &c.IdleStop, time.Second, "never stop an idle sandbox"},
		{"pull_before_expiry", f.PullBeforeExpiry, &c.PullBeforeExpiry, time.Second, "never pull before a reported expiry"},
	}
	for _, d := range durations {
		if d.src == nil {
			continue
		}
		v, err := time.ParseDuration(strings.TrimSpace(*d.src))
		if err != nil {
			errs = append(errs, fmt.Errorf("field %q: want a Go duration such as \"10m\" or \"1h30m\", got %q", d.name, *d.src))
			continue
		}
		if v < 0 || (v < d.min && !(v == 0 && d.zero != "")) {
			errs = append(errs, fmt.Errorf("field %q is %s; it must be at least %s", d.name, v, max(d.min, time.Nanosecond)))
			continue
		}
		*d.dst = v
	}
	if f.LogLevel != nil {
		lvl, err := ParseLogLevel(*f.LogLevel)
		if err != nil {
			errs = append(errs, fmt.Errorf("field \"log_level\": %w", err))
		} else {
			c.LogLevel = lvl
		}
	}
	return joinProblems(errs)
}

// fieldNames are the config file's fields, in the order of file: its
// json tags, so that a field added to file is known everywhere at once.
func fieldNames() []string {
	t := reflect.TypeFor[file]()
	names := make([]string, t.NumField())
	for i := range names {
		names[i] = t.Field(i).Tag.Get("json")
	}
	return names
}

// fields maps each string field of the file to where it is decoded (the
// one boolean, durable_exec, is decoded apart).
func (f *file) fields() map[string]**string {
	v := reflect.ValueOf(f).Elem()
	m := make(map[string]**string, v.NumField())
	for i := range v.NumField() {
		if p, ok := v.Field(i).Addr().Interface().(**string); ok {
			m[v.Type().Field(i).Tag.Get("json")] = p
		}
	}
	return m
}

// fieldFor finds key's field, case-insensitively as encoding/json does.
func fieldFor(fields map[string]**string, key string) **string {
	if dst, ok := fields[key]; ok {
		return dst
	}
	for name, dst := range fields {
		if strings.EqualFold(name, key) {
			return dst
		}
	}
	return nil
}

// problems is several config problems, reported on one line.
type problems []error

func (p problems) Error() string {
	msgs := make([]string, len(p))
	for i, e := range p {
		msgs[i] = e.Error()
	}
	return fmt.Sprintf("%d problems: %s", len(p), strings.Join(msgs, "; "))
}

func (p problems) Unwrap() []error { return p }

func joinProblems(errs []error) error {
	switch len(errs) {
	case 0:
		return nil
	case 1:
		return errs[0]
	}
	return problems(errs)
}

// ParseLogLevel parses debug, info, warn or error (any case).
func ParseLogLevel(s string) (slog.Level, error) {
	var l slog.Level
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "debug":
		l = slog.LevelDebug
	case "info":
		l = slog.LevelInfo
	case "warn", "warning":
		l = slog.LevelWarn
	case "error":
		l = slog.LevelError
	default:
		return l, fmt.Errorf("unknown log level %q: use debug, info, warn or error", s)
	}
	return l, nil
}

func checkRemote(v string) error {
	switch v {
	case RemoteLocal, RemoteRWX:
		return nil
	}
	return fmt.Errorf("unknown remote %q: use %q (the embedded local remote) or %q (RWX Cloud)", v, RemoteLocal, RemoteRWX)
}

// describeDecodeError turns encoding/json errors into messages that name
// the field or the line and column.
func describeDecodeError(raw []byte, err error) error {
	var syn *json.SyntaxError
	var typ *json.UnmarshalTypeError
	switch {
	case errors.As(err, &syn):
		line, col := lineCol(raw, syn.Offset)
		return fmt.Errorf("invalid JSON at line %d, column %d: %w", line, col, err)
	case errors.As(err, &typ):
		if typ.Field != "" {
			return fmt.Errorf("field %q: want a %s, got a JSON %s", typ.Field, jsonKind(typ.Type.Kind().String()), typ.Value)
		}
		return fmt.Errorf("want a JSON object, got a JSON %s", typ.Value)
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
		return errors.New("invalid JSON: the file ends before the object does")
	}
	if msg, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
		return fmt.Errorf("unknown field %s; known fields: %s", msg, strings.Join(fieldNames(), ", "))
	}
	return err
}

func jsonKind(goKind string) string {
	if goKind == "ptr" || goKind == "string" {
		return "string"
	}
	return goKind
}

func lineCol(raw []byte, off int64) (line, col int) {
	if off > int64(len(raw)) {
		off = int64(len(raw))
	}
	before := raw[:off]
	line = bytes.Count(before, []byte("\n")) + 1
	col = int(off) - bytes.LastIndexByte(before, '\n') - 1
	if col < 1 {
		col = 1
	}
	return line, col
}

// rwxCLIToken reads the access token the RWX CLI stores after `rwx login`:
// ~/.config/rwx/accesstoken, or the older ~/.mint/accesstoken. The CLI uses
// these fixed paths (not XDG_CONFIG_HOME) and trims whitespace.
func rwxCLIToken(home string) (token, source string, err error) {
	if home == "" {
		return "", "", nil
	}
	for _, p := range []string{
		filepath.Join(home, ".config", "rwx", "accesstoken"),
		filepath.Join(home, ".mint", "accesstoken"),
	} {
		b, err := os.ReadFile(p)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return "", "", fmt.Errorf("read the RWX CLI token file %s: %w", p, err)
		}
		if tok := strings.TrimSpace(string(b)); tok != "" {
			return tok, "RWX CLI token file " + p, nil
		}
	}
	return "", "", nil
}

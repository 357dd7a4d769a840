package store

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// LegacySession is one entry of the RWX CLI's .rwx/sandboxes/sandboxes.json.
type LegacySession struct {
	// Key is the entry's key as written in the file.
	Key string
	// Cwd is the working directory of old-format keys (cwd:branch:config);
	// empty for branch:config keys.
	Cwd string
	// Branch is the branch part of the key ("detached" or
	// "detached@<sha>" for a detached HEAD).
	Branch string
	// ConfigFile comes from the key (or from the record when the key has
	// none). A relative path in an old-format key is resolved against that
	// key's cwd, as the RWX CLI does when it migrates its own file; any
	// other relative path is left as written and is relative to the
	// repository root (the directory holding .rwx): toIdentity resolves it.
	// Empty when neither the key nor the record names one.
	ConfigFile string

	RunID       string
	ScopedToken string
	RunURL      string
	ConfigHash  string
	CreatedAt   time.Time
	LastExecAt  time.Time
	ExecCount   int
}

// legacyFile is the RWX CLI's on-disk format (SandboxStorage).
type legacyFile struct {
	Version   int                     `json:"version,omitempty"`
	Sandboxes map[string]legacyRecord `json:"sandboxes"`
}

type legacyRecord struct {
	RunID       string     `json:"runId"`
	ConfigFile  string     `json:"configFile"`
	ScopedToken string     `json:"scopedToken,omitempty"`
	RunURL      string     `json:"runUrl,omitempty"`
	ConfigHash  string     `json:"configHash,omitempty"`
	CreatedAt   *time.Time `json:"createdAt,omitempty"`
	LastExecAt  *time.Time `json:"lastExecAt,omitempty"`
	ExecCount   int        `json:"execCount,omitempty"`
}

// legacyKeyedVersion is the RWX CLI's storage version that introduced
// branch:config keys; files below it may hold cwd:branch:config keys.
const legacyKeyedVersion = 1

// ReadLegacyFile parses an RWX CLI sandboxes.json, sorted by key. A missing
// file is an error satisfying errors.Is(err, os.ErrNotExist); malformed
// JSON is an ErrLegacyMalformed error naming the file.
func ReadLegacyFile(path string) ([]LegacySession, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read RWX CLI sandboxes file: %w", err)
	}
	return ParseLegacy(path, data)
}

// ParseLegacy parses the contents of the RWX CLI sandboxes.json at path
// (named in errors), like ReadLegacyFile; the caller reads the file, within
// whatever limits it applies to repository files.
func ParseLegacy(path string, data []byte) ([]LegacySession, error) {
	var f legacyFile
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("%w: %s: %v; fix or remove it (sandboxd imports nothing from it)", ErrLegacyMalformed, path, err)
	}
	out := make([]LegacySession, 0, len(f.Sandboxes))
	for key, rec := range f.Sandboxes {
		ls := LegacySession{
			Key:         key,
			RunID:       rec.RunID,
			ScopedToken: rec.ScopedToken,
			RunURL:      rec.RunURL,
			ConfigHash:  rec.ConfigHash,
			ExecCount:   rec.ExecCount,
		}
		if rec.CreatedAt != nil {
			ls.CreatedAt = *rec.CreatedAt
		}
		if rec.LastExecAt != nil {
			ls.LastExecAt = *rec.LastExecAt
		}
		if cwd, branch, cfg, ok := parseOldLegacyKey(key); ok && f.Version < legacyKeyedVersion {
			ls.Cwd, ls.Branch, ls.ConfigFile = cwd, branch, cfg
		} else {
			ls.Branch, ls.ConfigFile = parseLegacyKey(key)
		}
		if ls.ConfigFile == "" && rec.ConfigFile != "" {
			ls.ConfigFile = rec.ConfigFile
			if ls.Cwd != "" && !filepath.IsAbs(ls.ConfigFile) {
				ls.ConfigFile = filepath.Join(ls.Cwd, ls.ConfigFile)
			}
		}
		if ls.Branch == "" {
			ls.Branch = "detached" // what the RWX CLI keys an unknown branch as
		}
		out = append(out, ls)
	}
	slices.SortFunc(out, func(a, b LegacySession) int { return strings.Compare(a.Key, b.Key) })
	return out, nil
}

// parseOldLegacyKey recognizes the RWX CLI's version-0 keys,
// "cwd:branch:config", the way the CLI itself does: an absolute cwd and a
// YAML config file. A relative config is resolved against the cwd.
func parseOldLegacyKey(key string) (cwd, branch, cfg string, ok bool) {
	last := strings.LastIndex(key, ":")
	if last < 0 {
		return "", "", "", false
	}
	cfg, rest := key[last+1:], key[:last]
	second := strings.LastIndex(rest, ":")
	if second < 0 {
		return "", "", "", false
	}
	cwd, branch = rest[:second], rest[second+1:]
	if !strings.HasPrefix(cwd, "/") || !(strings.HasSuffix(cfg, ".yml") || strings.HasSuffix(cfg, ".yaml")) {
		return "", "", "", false
	}
	if !filepath.IsAbs(cfg) {
		cfg = filepath.Join(cwd, cfg)
	}
	return cwd, branch, cfg, true
}

// parseLegacyKey splits a "branch:config" key like the RWX CLI: at the
// first ":/" (config paths are absolute and branch names cannot hold ':'),
// else at the last ':'.
func parseLegacyKey(key string) (branch, cfg string) {
	if i := strings.Index(key, ":/"); i >= 0 {
		return key[:i], key[i+1:]
	}
	if i := strings.LastIndex(key, ":"); i >= 0 {
		return key[:i], key[i+1:]
	}
	return key, ""
}

// legacyImportRecord is what legacy_imports remembers per repository.
type legacyImportRecord struct {
	ImportedAt time.Time `json:"importedAt"`
	Imported   int       `json:"imported"`
	Skipped    int       `json:"skipped"`
}

// LegacyImported reports whether ImportLegacy already ran for repoRoot. An
// unreadable store answers false (the import then fails with the error).
func (s *Store) LegacyImported(repoRoot string) bool {
	done := false
	_ = s.view(func(t *txn) error {
		done = t.legacy.Get([]byte(repoRoot)) != nil
		return nil
	})
	return done
}

// ImportLegacy imports, in one transaction, the legacy sessions of the
// repository at repoRoot whose identity (from toIdentity) has no live
// session and whose run id is not recorded yet; each becomes an Adopted
// session in StateUnknown on the given remote, keeping its run URL, token,
// config hash, times and exec count. Entries without a run id are skipped.
// It records that repoRoot was imported (even when nothing was), so a
// second call imports nothing and returns 0.
func (s *Store) ImportLegacy(repoRoot string, sessions []LegacySession, toIdentity func(LegacySession) Identity, remote string) (int, error) {
	imported := 0
	err := s.update(func(t *txn) error {
		imported = 0
		if t.legacy.Get([]byte(repoRoot)) != nil {
			return nil
		}
		now := s.now().UTC()
		for _, ls := range sessions {
			if ls.RunID == "" {
				continue
			}
			id, err := s.newID()
			if err != nil {
				return err
			}
			sess := &Session{
				ID:          id,
				Identity:    toIdentity(ls),
				Remote:      remote,
				RunID:       ls.RunID,
				RunURL:      ls.RunURL,
				Token:       ls.ScopedToken,
				ConfigHash:  ls.ConfigHash,
				State:       StateUnknown,
				StateReason: "imported from the RWX CLI's sandboxes.json",
				CreatedAt:   ls.CreatedAt.UTC(),
				UpdatedAt:   now,
				LastExecAt:  ls.LastExecAt.UTC(),
				ExecCount:   int64(ls.ExecCount),
				Adopted:     true,
			}
			if sess.CreatedAt.IsZero() {
				sess.CreatedAt = now
			}
			if err := t.index(nil, sess); err != nil {
				if exists := (*ExistsError)(nil); errors.As(err, &exists) {
					s.log.Info("legacy import: skipped a session whose identity or run is already known", "repo", repoRoot, "run", ls.RunID)
					continue
				}
				return err
			}
			if err := t.put(sess); err != nil {
				return err
			}
			imported++
		}
		rec, err := json.Marshal(legacyImportRecord{ImportedAt: now, Imported: imported, Skipped: len(sessions) - imported})
		if err != nil {
			return err
		}
		return t.legacy.Put([]byte(repoRoot), rec)
	})
	if err != nil {
		return 0, fmt.Errorf("import the RWX CLI's sessions of %s: %w", repoRoot, err)
	}
	return imported, nil
}

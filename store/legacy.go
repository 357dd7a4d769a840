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

	"github.com/sandboxd/sandboxd/clifile"
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
		if cwd, branch, cfg, ok := clifile.ParseOldKey(key); ok && f.Version < clifile.Version {
			ls.Cwd, ls.Branch, ls.ConfigFile = cwd, branch, cfg
		} else {
			ls.Branch, ls.ConfigFile = clifile.ParseKey(key)
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

// AdoptLegacy records, in one transaction, the sessions of an RWX CLI
// sandboxes.json that sandboxd does not know yet; the daemon calls it
// whenever the file changes. An entry is skipped when it has no run id, when
// toIdentity rejects it, when its run id is recorded already (live or
// ended: an ended run never comes back) or when its identity has a live
// session. Each other entry becomes an Adopted session in StateUnknown on
// the given remote, keeping its run URL, token, config hash, times and exec
// count. It returns the sessions recorded.
func (s *Store) AdoptLegacy(sessions []LegacySession, toIdentity func(LegacySession) (Identity, bool), remote string) ([]*Session, error) {
	var adopted []*Session
	err := s.update(func(t *txn) error {
		adopted = nil
		now := s.now().UTC()
		for _, ls := range sessions {
			if ls.RunID == "" {
				continue
			}
			identity, ok := toIdentity(ls)
			if !ok {
				continue
			}
			id, err := s.newID()
			if err != nil {
				return err
			}
			sess := &Session{
				ID:          id,
				Identity:    identity,
				Remote:      remote,
				RunID:       ls.RunID,
				RunURL:      ls.RunURL,
				Token:       ls.ScopedToken,
				ConfigHash:  ls.ConfigHash,
				State:       StateUnknown,
				StateReason: "adopted from the RWX CLI's sandboxes.json",
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
					continue
				}
				return err
			}
			if err := t.put(sess); err != nil {
				return err
			}
			adopted = append(adopted, sess)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("adopt the RWX CLI's sessions: %w", err)
	}
	return adopted, nil
}

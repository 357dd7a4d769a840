package store

import "bytes"

// LiveOnBranch returns the live sessions of a repository's branch, whatever
// their config, in config order: one prefix scan of the identity index,
// cheap enough for every exec.
func (s *Store) LiveOnBranch(repoRoot, branch string) ([]*Session, error) {
	var out []*Session
	prefix := []byte(Identity{RepoRoot: repoRoot, Branch: branch}.Key()) // ends with the separator
	err := s.view(func(t *txn) error {
		c := t.byIdentity.Cursor()
		for k, v := c.Seek(prefix); k != nil && bytes.HasPrefix(k, prefix); k, v = c.Next() {
			sess, err := t.get(string(v))
			if err != nil {
				return err
			}
			out = append(out, sess)
		}
		return nil
	})
	return out, err
}

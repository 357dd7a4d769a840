package store

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// BenchmarkOpenAndList1000 is the daemon's rehydration read: open the store
// (read-only inspection with the page check, then the read-write open) and
// list 1,000 sessions of realistic size.
func BenchmarkOpenAndList1000(b *testing.B) {
	path := filepath.Join(isolate(b), "sandboxd.db")
	s, err := Open(context.Background(), path, Options{})
	must(b, err)
	now := time.Now().UTC()
	must(b, s.update(func(t *txn) error {
		for i := range 1000 {
			sess := &Session{
				ID:             fmt.Sprintf("%024x", i),
				Identity:       Identity{RepoRoot: fmt.Sprintf("/home/u/src/repo%d", i%50), Branch: fmt.Sprint("branch-", i), ConfigFile: "/home/u/src/repo/.rwx/sandbox.yml"},
				Remote:         "local",
				RunID:          fmt.Sprintf("run-%032x", i),
				RunURL:         fmt.Sprintf("https://cloud.rwx.com/runs/%032x", i),
				Token:          strings.Repeat("t", 64),
				IdempotencyKey: fmt.Sprintf("%032x", i),
				ConfigHash:     strings.Repeat("h", 64),
				BaseSHA:        strings.Repeat("a", 40),
				Address:        "127.0.0.1:40000",
				PublicHostKey:  strings.Repeat("k", 80),
				PrivateUserKey: strings.Repeat("p", 400),
				State:          StateReady,
				CreatedAt:      now.Add(time.Duration(i) * time.Second),
				UpdatedAt:      now,
			}
			if i%4 == 0 {
				sess.State, sess.EndedAt = StateExpired, now
			}
			if err := t.index(nil, sess); err != nil {
				return err
			}
			if err := t.put(sess); err != nil {
				return err
			}
		}
		return nil
	}))
	must(b, s.Close())

	for b.Loop() {
		s, err := Open(context.Background(), path, Options{})
		if err != nil {
			b.Fatal(err)
		}
		all, err := s.List()
		if err != nil || len(all) != 1000 {
			b.Fatalf("List: %d, %v", len(all), err)
		}
		must(b, s.Close())
	}
}

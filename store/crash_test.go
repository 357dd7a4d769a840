package store

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// crashChildEnv makes the test binary act as a writer child (see TestMain).
const crashChildEnv = "SANDBOXD_STORE_TEST_CRASH_CHILD"

// crashChild writes sessions in a loop until it is killed: inserts of new
// identities, run id changes, identity changes and terminal transitions, so
// that a kill lands in the middle of every kind of index update. After each
// committed transaction it prints "committed <id>".
func crashChild(path string) int {
	s, err := Open(context.Background(), path, Options{LockTimeout: 5 * time.Second})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	out := bufio.NewWriter(os.Stdout)
	for i := 0; ; i++ {
		id := Identity{RepoRoot: "/src/repo", Branch: fmt.Sprint("b", i%25), ConfigFile: "/src/repo/.rwx/sandbox.yml"}
		sess := &Session{Identity: id, RunID: fmt.Sprint("run-", os.Getpid(), "-", i), Token: strings.Repeat("t", 200), State: StateProvisioning}
		err := s.Insert(sess)
		var exists *ExistsError
		switch {
		case err == nil:
		case errors.As(err, &exists):
			// Move the identity's live session on: new run id, and every
			// third time end it (its identity entry is released).
			sess, err = s.Update(exists.Existing.ID, func(x *Session) error {
				x.RunID = fmt.Sprint("run-", os.Getpid(), "-", i)
				x.ExecCount++
				if i%3 == 0 {
					x.State = StateExpired
				}
				return nil
			})
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Fprintln(out, "committed", sess.ID)
		_ = out.Flush()
	}
}

// TestReopenAfterCrashMidWrite SIGKILLs a child process that is writing
// sessions, then checks that the store opens, every session the child saw
// committed is readable, and the indices agree with the records.
func TestReopenAfterCrashMidWrite(t *testing.T) {
	path := filepath.Join(isolate(t), "sandboxd.db")
	for round := range 3 {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), crashChildEnv+"="+path)
		stdout, err := cmd.StdoutPipe()
		must(t, err)
		var stderr strings.Builder
		cmd.Stderr = &stderr
		must(t, cmd.Start())
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })

		committed := map[string]bool{}
		sc := bufio.NewScanner(stdout)
		killAt := 40 + 17*round // vary the point in the write loop
		for n := 0; sc.Scan(); n++ {
			if id, ok := strings.CutPrefix(sc.Text(), "committed "); ok {
				committed[id] = true
			}
			if n == killAt {
				// While the child writes, it holds the lock: another
				// process's Open fails fast.
				if _, err := Open(context.Background(), path, Options{LockTimeout: 50 * time.Millisecond}); !errors.Is(err, ErrLocked) {
					t.Errorf("round %d: Open while the child holds the store: err = %v, want ErrLocked", round, err)
				}
				must(t, cmd.Process.Signal(syscall.SIGKILL))
			}
		}
		err = cmd.Wait()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("round %d: child did not die of SIGKILL: %v; stderr: %s", round, err, stderr.String())
		}
		if len(committed) == 0 {
			t.Fatalf("round %d: child committed nothing; stderr: %s", round, stderr.String())
		}

		s, err := Open(context.Background(), path, Options{LockTimeout: time.Second})
		if err != nil {
			t.Fatalf("round %d: reopen after SIGKILL: %v", round, err)
		}
		mustVerify(t, s)
		all, err := s.List()
		must(t, err)
		for id := range committed {
			if _, err := s.Get(id); err != nil {
				t.Errorf("round %d: committed session %s lost: %v", round, id, err)
			}
		}
		live := map[string]int{}
		for _, x := range all {
			if !x.State.Terminal() {
				live[x.Key()]++
				if got, err := s.ByIdentity(x.Identity); err != nil || got.ID != x.ID {
					t.Errorf("round %d: ByIdentity(%s) = %v, %v", round, x.Branch, got, err)
				}
			}
			if got, err := s.ByRunID(x.RunID); err != nil || got.ID != x.ID {
				t.Errorf("round %d: ByRunID(%s) = %v, %v", round, x.RunID, got, err)
			}
		}
		for k, n := range live {
			if n > 1 {
				t.Errorf("round %d: %d live sessions for identity %q", round, n, k)
			}
		}
		t.Logf("round %d: %d sessions after the crash, %d seen committed", round, len(all), len(committed))
		must(t, s.Close())
	}
}

package localcloud

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/localcloud/runs"
)

// stopServer stops the server of dir by its discovered pid.
func stopServer(t *testing.T, dir string) {
	t.Helper()
	if _, err := Stop(context.Background(), dir, 15*time.Second); err != nil && !errors.Is(err, ErrNotRunning) {
		t.Error(err)
	}
}

func TestEnsureRunningStartsOneServerForRacingCallers(t *testing.T) {
	isolate(t)
	t.Setenv(asBinaryEnv, "1") // the test binary serves as sandboxd-localcloud
	dir := filepath.Join(t.TempDir(), "state")
	t.Cleanup(func() { stopServer(t, dir) })

	if _, err := ReadDiscovery(dir); !errors.Is(err, ErrNotRunning) {
		t.Fatalf("before start: %v", err)
	}
	var wg sync.WaitGroup
	results := make([]Discovery, 4)
	errs := make([]error, 4)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = EnsureRunning(context.Background(), EnsureOptions{Dir: dir, Binary: os.Args[0]})
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("caller %d: %v", i, err)
		}
		if results[i].PID != results[0].PID {
			t.Fatalf("two servers: pids %d and %d", results[0].PID, results[i].PID)
		}
	}
	d := results[0]
	if d.APIURL == "" || d.CertFile == "" || d.TokenFile == "" || d.Version == "" || d.StartedAt.IsZero() {
		t.Fatalf("discovery %+v", d)
	}
	if st, _ := os.Stat(d.TokenFile); st.Mode().Perm() != 0o600 {
		t.Fatalf("token file mode %v", st.Mode())
	}
	if st, _ := os.Stat(dir); st.Mode().Perm() != 0o700 {
		t.Fatalf("state dir mode %v", st.Mode())
	}
	// A live one is returned as is.
	again, err := EnsureRunning(context.Background(), EnsureOptions{Dir: dir, Binary: os.Args[0]})
	if err != nil || again.PID != d.PID {
		t.Fatalf("second ensure: %+v %v", again, err)
	}
	if _, err := Stop(context.Background(), dir, 15*time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := Status(context.Background(), dir); !errors.Is(err, ErrNotRunning) {
		t.Fatalf("after stop: %v", err)
	}
}

func TestEnsureRunningReportsTheLogOfAFailedStart(t *testing.T) {
	isolate(t)
	t.Setenv(asBinaryEnv, "1")
	dir := filepath.Join(t.TempDir(), "state")
	_, err := EnsureRunning(context.Background(), EnsureOptions{Dir: dir, Binary: os.Args[0], Args: []string{"--no-such-flag"}})
	if err == nil || !strings.Contains(err.Error(), "exited before serving") || !strings.Contains(err.Error(), "no-such-flag") {
		t.Fatalf("got %v", err)
	}
}

func TestStaleDiscoveryIsNotTrusted(t *testing.T) {
	isolate(t)
	dir := filepath.Join(t.TempDir(), "state")
	startServer(t, Config{Dir: dir})
	d, err := Status(context.Background(), dir)
	if err != nil {
		t.Fatal(err)
	}
	// A discovery file naming a dead pid (a SIGKILLed server).
	d.PID = deadPID(t)
	b := []byte(`{"api_url":"` + d.APIURL + `","cert_file":"` + d.CertFile + `","token_file":"` + d.TokenFile + `","pid":` + itoa(d.PID) + `}`)
	if err := runs.WriteFileAtomic(filepath.Join(dir, DiscoveryFile), b, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Status(context.Background(), dir); !errors.Is(err, ErrNotRunning) {
		t.Fatalf("dead pid trusted: %v", err)
	}
	// A live pid that is not the server (ours) is not trusted either.
	b = []byte(strings.Replace(string(b), itoa(d.PID), itoa(os.Getppid()), 1))
	runs.WriteFileAtomic(filepath.Join(dir, DiscoveryFile), b, 0o600)
	if _, err := Status(context.Background(), dir); !errors.Is(err, ErrNotRunning) {
		t.Fatalf("foreign pid trusted: %v", err)
	}
	os.WriteFile(filepath.Join(dir, DiscoveryFile), []byte("garbage"), 0o600)
	if _, err := ReadDiscovery(dir); !errors.Is(err, ErrNotRunning) {
		t.Fatalf("damaged discovery: %v", err)
	}
}

func deadPID(t *testing.T) int {
	t.Helper()
	for pid := 4_000_000; pid > 3_000_000; pid-- {
		if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
			return pid
		}
	}
	t.Fatal("no free pid")
	return 0
}

func itoa(i int) string { return strconv.Itoa(i) }

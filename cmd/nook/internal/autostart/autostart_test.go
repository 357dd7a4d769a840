package autostart

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sandboxd/sandboxd/ipc/client"
	"github.com/sandboxd/sandboxd/ipc/server"
)

// TestMain doubles as a fake sandboxd when AUTOSTART_TEST_MODE is set.
func TestMain(m *testing.M) {
	switch os.Getenv("AUTOSTART_TEST_MODE") {
	case "serve":
		ln, err := net.Listen("unix", os.Getenv("SANDBOXD_SOCKET"))
		if err != nil {
			fmt.Fprintln(os.Stderr, "sandboxd:", err)
			os.Exit(1)
		}
		srv := server.New(server.Backends{}, server.Options{Version: "fake"})
		go func() {
			c := make(chan os.Signal, 1)
			signal.Notify(c, syscall.SIGTERM)
			<-c
			srv.Shutdown(context.Background())
		}()
		fmt.Println("fake sandboxd serving")
		srv.Serve(ln)
		os.Exit(0)
	case "fail":
		fmt.Fprintln(os.Stderr, "sandboxd: open /x/sandboxd.db: database is locked by another sandboxd (pid 42)")
		os.Exit(1)
	}
	os.Exit(m.Run())
}

func setup(t *testing.T, mode string) (Options, string) {
	dir, err := os.MkdirTemp("", "nook")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "d.sock")
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	c := client.New(sock)
	t.Cleanup(c.Close)
	return Options{
		Daemon:  self,
		Env:     []string{"AUTOSTART_TEST_MODE=" + mode, "SANDBOXD_SOCKET=" + sock, "HOME=" + dir},
		LogFile: filepath.Join(dir, "state", "sandboxd", "sandboxd.log"),
		Ready: func(ctx context.Context) bool {
			_, err := c.Version(ctx)
			return err == nil
		},
	}, sock
}

func TestStartDetachedAndServing(t *testing.T) {
	o, _ := setup(t, "serve")
	st, err := Start(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		syscall.Kill(st.PID, syscall.SIGTERM)
		for i := 0; i < 200 && syscall.Kill(st.PID, 0) == nil; i++ {
			time.Sleep(10 * time.Millisecond)
		}
		syscall.Kill(st.PID, syscall.SIGKILL)
	})
	if sid, err := unix.Getsid(st.PID); err != nil || sid != st.PID {
		t.Errorf("daemon session id %d (%v), want its own session %d", sid, err, st.PID)
	}
	if !o.Ready(context.Background()) {
		t.Fatal("not serving after Start returned")
	}
	b, _ := os.ReadFile(o.LogFile)
	if !strings.Contains(string(b), "fake sandboxd serving") {
		t.Fatalf("log %q", b)
	}
	if fi, err := os.Stat(o.LogFile); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("log mode %v %v", fi.Mode(), err)
	}
}

func TestStartReportsTheDaemonsOwnError(t *testing.T) {
	o, _ := setup(t, "fail")
	if err := os.MkdirAll(filepath.Dir(o.LogFile), 0o700); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(o.LogFile, []byte("old line from an earlier run\n"), 0o600)
	o.Timeout = time.Minute // an early exit must not wait for this
	began := time.Now()
	_, err := Start(context.Background(), o)
	var exited *ExitedError
	if !errors.As(err, &exited) {
		t.Fatalf("error %v, want an ExitedError", err)
	}
	if !strings.Contains(err.Error(), "database is locked by another sandboxd") || strings.Contains(err.Error(), "old line") {
		t.Fatalf("error %q should carry the daemon's output of this run only", err)
	}
	if time.Since(began) > 30*time.Second {
		t.Fatal("waited for the timeout instead of noticing the exit")
	}
}

func TestFindDaemonMissing(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	if _, err := FindDaemon(); err == nil || !strings.Contains(err.Error(), "neither next to this nook nor on PATH") {
		t.Fatalf("FindDaemon with no sandboxd: %v", err)
	}
}

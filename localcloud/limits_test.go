//go:build linux

package localcloud

import (
	"strings"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/localcloud/runs"
	"github.com/sandboxd/sandboxd/localcloud/sandbox"
)

// TestRunOverItsDiskLimitIsEnded: a run whose files grow over its disk
// limit (in files each under the file-size limit) is ended, saying why,
// and the status says how the limits are enforced.
func TestRunOverItsDiskLimitIsEnded(t *testing.T) {
	isolate(t)
	srv := startServer(t, Config{Sandbox: sandbox.Options{DiskBytes: 8 << 20, FileBytes: 4 << 20, DiskCheckEvery: 50 * time.Millisecond}})
	r := srv.isolationReport()
	if r.Limits["disk"] != "watchdog" || r.Limits["file-size"] != "rlimit" || r.Limits["inotify"] != "userns" {
		t.Fatalf("the status does not say how disk, file size and inotify are limited: %+v", r)
	}
	c := newClient(t, srv)
	id := c.create(repo(t, plainConfig), "")
	c.waitState(id, runs.Sandboxable)
	sc := dialSandbox(t, c.connInfo(id))
	// 12 MiB in three files of 4 MiB, each within the file-size limit.
	if out, err := sandboxRun(t, sc, "for i in 1 2 3; do head -c 4194304 /dev/zero > fill$i || exit 1; done; sleep 30"); err == nil {
		t.Logf("the filling command ended by itself: %q", out)
	}
	st := waitCompleted(t, c, id)
	if st.Reason != runs.ReasonFailed || !strings.Contains(st.Detail, "disk limit") {
		t.Fatalf("the run ended with %+v, want failed: disk limit", st)
	}
}

package repocheck

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

const module = "github.com/sandboxd/sandboxd/"

// deps lists the packages the given patterns (relative to the module's
// root) link, themselves included.
func deps(t *testing.T, patterns ...string) []string {
	t.Helper()
	cmd := exec.Command("go", append([]string{"list", "-deps"}, patterns...)...)
	cmd.Dir = filepath.Join("..", "..")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps %s: %v\n%s", strings.Join(patterns, " "), err, out)
	}
	return strings.Fields(string(out))
}

// within reports whether pkg is the module's package root or one of its
// subpackages.
func within(pkg, root string) bool {
	return pkg == module+root || strings.HasPrefix(pkg, module+root+"/")
}

// The daemon's domain serves the socket API through the interfaces of
// ipc/backend; only the command (cmd/sandboxd) links the transport.
func TestDaemonDoesNotLinkTheSocketServer(t *testing.T) {
	for _, pkg := range deps(t, "./daemon/...") {
		if pkg == module+"ipc/server" {
			t.Errorf("a package under daemon/ links ipc/server: implement ipc/backend's interfaces instead, and let cmd/sandboxd plug the server in (daemon.Options.NewServer)")
		}
	}
}

// The daemon and the helper share only their contract (internal/helperproto):
// the daemon links none of the helper's implementation.
func TestDaemonDoesNotLinkTheHelper(t *testing.T) {
	for _, pkg := range deps(t, "./daemon/...", "./cmd/sandboxd") {
		if within(pkg, "sandboxhelper") {
			t.Errorf("the daemon links %s: what both sides share belongs in internal/helperproto", pkg)
		}
	}
}

// The helper runs in the sandbox: it links nothing of the daemon (the file
// watcher both use is internal/watch).
func TestHelperDoesNotLinkTheDaemon(t *testing.T) {
	for _, pkg := range deps(t, "./sandboxhelper/...", "./cmd/sandboxd-helper") {
		if within(pkg, "daemon") {
			t.Errorf("the helper links %s: move what daemon and helper share out of daemon/ (as internal/watch)", pkg)
		}
	}
}

// The daemon finds, starts and stops the local remote through
// localcloud/discovery; it does not link the server it starts.
func TestDaemonLinksOnlyLocalcloudDiscovery(t *testing.T) {
	for _, pkg := range deps(t, "./daemon/...", "./cmd/sandboxd") {
		for _, banned := range []string{"localcloud", "localcloud/runs", "localcloud/agent", "localcloud/provision"} {
			if pkg == module+banned {
				t.Errorf("the daemon links %s: it needs only localcloud/discovery", pkg)
			}
		}
	}
}

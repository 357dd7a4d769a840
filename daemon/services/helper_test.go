package services

import (
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/sandboxd/sandboxd/daemon/config"
	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// The helper next to sandboxd serves every remote's sandboxes by default,
// RWX Cloud's included; "off" and a path are obeyed.
func TestHelperOptions(t *testing.T) {
	if runtime.GOOS != "linux" || (runtime.GOARCH != "amd64" && runtime.GOARCH != "arm64") {
		t.Skip("the helper serves Linux on amd64 and arm64 only")
	}
	dir := t.TempDir()
	next := filepath.Join(dir, helperproto.Name)
	if err := os.WriteFile(next, []byte("x"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		remote, setting, want string
	}{
		{config.RemoteLocal, "", next},
		{config.RemoteRWX, "", next},
		{config.RemoteRWX, config.SyncHelperOff, ""},
		{config.RemoteRWX, config.SyncHelperOn, next},
		{config.RemoteLocal, config.SyncHelperOff, ""},
		{config.RemoteRWX, "/opt/helper", "/opt/helper"},
	} {
		o := helperOptions(config.Config{Remote: tc.remote, SyncHelper: tc.setting}, nil, dir)
		if o.Binary != tc.want {
			t.Errorf("remote %s, sync_helper %q: binary %q, want %q", tc.remote, tc.setting, o.Binary, tc.want)
		}
	}
	if o := helperOptions(config.Config{Remote: config.RemoteLocal}, nil, t.TempDir()); o.Binary != "" {
		t.Errorf("no helper next to sandboxd, yet binary %q", o.Binary)
	}
}

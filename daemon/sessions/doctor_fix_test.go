package sessions

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

// downLocal is a local remote that did not start, for the reason given.
type downLocal struct{ err error }

func (d downLocal) Remote(context.Context) (Remote, error) { return nil, d.err }
func (d downLocal) Info() RemoteInfo                       { return RemoteInfo{Name: "local", Host: "127.0.0.1:1"} }

// TestDoctorSaysHowToRunWithoutBubblewrap: when the local remote cannot
// start for want of bubblewrap, doctor's fix says to install it or names
// the exact setting that runs sandboxes unisolated, not the network and
// the access token (which the local remote has nothing to do with).
func TestDoctorSaysHowToRunWithoutBubblewrap(t *testing.T) {
	m, _ := newTestManager(t, newFakeRemoteAPI(t), time.Second)
	m.opts.Remotes = downLocal{errors.New("start the local remote: sandboxes unavailable: bwrap is not installed: install the bubblewrap package")}
	resp, err := m.Doctor(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range resp.Checks {
		if c.Name != "remote" {
			continue
		}
		if c.OK || !strings.Contains(c.Fix, "apt install bubblewrap") || !strings.Contains(c.Fix, "SANDBOXD_LOCALCLOUD_ISOLATION=none") || strings.Contains(c.Fix, "access token") {
			t.Fatalf("doctor's remote check for a local remote without bubblewrap: %+v", c)
		}
		return
	}
	t.Fatalf("no remote check: %+v", resp.Checks)
}

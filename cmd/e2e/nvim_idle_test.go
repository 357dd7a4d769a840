package e2e

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"testing"
)

// TestNeovimStatuslineCountsDownToTheIdleStop: with idle_stop set, the
// plugin's statusline shows the session.idle_warning as a countdown ("idle
// stop in 9s") that counts down each second, and clears it once the
// sandbox is used (an exec), in a headless Neovim against a real daemon
// and localcloud (cmd/e2e/testdata/nvim_idle.lua drives it).
func TestNeovimStatuslineCountsDownToTheIdleStop(t *testing.T) {
	t.Parallel()
	nvim := needTool(t, "nvim", "apt-get install neovim")
	_, here, _, _ := runtime.Caller(0)
	plugin := filepath.Join(filepath.Dir(here), "..", "..", "contrib", "nvim")
	script := filepath.Join(filepath.Dir(here), "testdata", "nvim_idle.lua")
	e := newEnv(t)
	// The warning comes half of idle_stop before the stop: at 15s idle.
	e.idleStopConfig("30s")
	e.startDaemon()
	repo := e.newRepo("nvimidle", defaultConfig)
	e.startSandbox(repo)

	outFile := filepath.Join(e.root, "nvim.json")
	cmd := exec.Command(nvim, "--headless", "-u", "NONE", "-i", "NONE", "-n",
		"--cmd", "set rtp^="+plugin, "-c", "luafile "+script)
	cmd.Dir = repo
	cmd.Env = e.with("NOOK_NVIM_OUT=" + outFile)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("nvim: %v\n%s", err, out)
	}
	b, err := os.ReadFile(outFile)
	if err != nil {
		t.Fatalf("the Neovim script wrote no result: %v", err)
	}
	var got struct {
		Error          string `json:"error"`
		CountdownFirst string `json:"countdown_first"`
		CountdownLater string `json:"countdown_later"`
		AfterUse       string `json:"after_use"`
	}
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatalf("result %s: %v", b, err)
	}
	if got.Error != "" {
		t.Fatalf("the Neovim script failed: %s\nresult: %s", got.Error, b)
	}
	re := regexp.MustCompile(`^nook:ready idle stop in (\d+)s$`)
	first, later := re.FindStringSubmatch(got.CountdownFirst), re.FindStringSubmatch(got.CountdownLater)
	if first == nil || later == nil {
		t.Fatalf("statusline after the idle warning: %q, then %q; want \"nook:ready idle stop in Ns\"", got.CountdownFirst, got.CountdownLater)
	}
	a, _ := strconv.Atoi(first[1])
	z, _ := strconv.Atoi(later[1])
	if a > 15 || z >= a {
		t.Errorf("the countdown does not count down from the warning's lead: %q, 2s later %q", got.CountdownFirst, got.CountdownLater)
	}
	if got.AfterUse != "nook:ready" {
		t.Errorf("after an exec the statusline is %q, want the countdown cleared", got.AfterUse)
	}
}

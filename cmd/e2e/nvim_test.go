package e2e

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// TestNeovimPlugin runs contrib/nvim in a headless Neovim against a real
// daemon and localcloud (cmd/e2e/testdata/nvim_e2e.lua drives it): :Nook
// exec streams output into a buffer as it comes (the first line is there
// while the command still runs), stderr highlighted apart, the exit code
// shown; Ctrl-C in the buffer interrupts the remote command; the quickfix
// list is filled from the output; status, list and stop answer; the
// statusline follows /v1/events (running, config drift, stopped);
// :checkhealth nook reports the daemon.
func TestNeovimPlugin(t *testing.T) {
	t.Parallel()
	nvim := needTool(t, "nvim", "apt-get install neovim")
	_, here, _, _ := runtime.Caller(0)
	plugin := filepath.Join(filepath.Dir(here), "..", "..", "contrib", "nvim")
	script := filepath.Join(filepath.Dir(here), "testdata", "nvim_e2e.lua")
	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("nvimrepo", defaultConfig)
	e.mustNook(repo, "start", "--wait")

	outFile := filepath.Join(e.root, "nvim.json")
	cmd := exec.Command(nvim, "--headless", "-u", "NONE", "-i", "NONE", "-n",
		"--cmd", "set rtp^="+plugin, "-c", "luafile "+script)
	cmd.Dir = repo
	cmd.Env = e.with("NOOK_NVIM_OUT="+outFile, "NOOK_NVIM_FLAG="+filepath.Join(e.root, "go.flag"))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("nvim: %v\n%s", err, out)
	}
	b, err := os.ReadFile(outFile)
	if err != nil {
		t.Fatalf("the Neovim script wrote no result: %v", err)
	}
	var got struct {
		Error           string   `json:"error"`
		BeforeEnd       string   `json:"before_end"`
		DoneBeforeEnd   bool     `json:"done_before_end"`
		Streamed        string   `json:"streamed"`
		ExitCode        int      `json:"exit_code"`
		StderrLines     []string `json:"stderr_lines"`
		Interrupted     string   `json:"interrupted"`
		InterruptedCode int      `json:"interrupted_code"`
		Quickfix        []struct {
			File string `json:"file"`
			Lnum int    `json:"lnum"`
		} `json:"quickfix"`
		Status            string `json:"status"`
		ListCount         int    `json:"list_count"`
		StatuslineRunning string `json:"statusline_running"`
		StatuslineIdle    string `json:"statusline_idle"`
		StatuslineDrift   string `json:"statusline_drift"`
		StatuslineStopped string `json:"statusline_stopped"`
		Health            string `json:"health"`
		Stopped           int    `json:"stopped"`
	}
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatalf("result %s: %v", b, err)
	}
	if got.Error != "" {
		t.Fatalf("the Neovim script failed: %s\nresult: %s", got.Error, b)
	}
	if !strings.Contains(got.BeforeEnd, "first") || strings.Contains(got.BeforeEnd, "second") || got.DoneBeforeEnd {
		t.Errorf("output was not streamed: before the end the buffer held %q (done %v)", got.BeforeEnd, got.DoneBeforeEnd)
	}
	// stdout and stderr are two streams: only the order within one holds.
	lines := strings.Split(got.Streamed, "\n")
	if len(lines) != 4 || !strings.HasPrefix(lines[3], "[exit 3,") || got.ExitCode != 3 ||
		strings.Index(got.Streamed, "first") > strings.Index(got.Streamed, "second") || !strings.Contains(got.Streamed, "to-stderr\n") {
		t.Errorf("exec buffer: %q, exit %d", got.Streamed, got.ExitCode)
	}
	if len(got.StderrLines) != 1 || got.StderrLines[0] != "to-stderr" {
		t.Errorf("stderr lines highlighted: %q", got.StderrLines)
	}
	if got.InterruptedCode != 130 || !strings.Contains(got.Interrupted, "signal INT") {
		t.Errorf("Ctrl-C: %q, exit %d", got.Interrupted, got.InterruptedCode)
	}
	if len(got.Quickfix) != 1 || got.Quickfix[0].File != "README.md" || got.Quickfix[0].Lnum != 1 {
		t.Errorf("quickfix: %+v", got.Quickfix)
	}
	if got.Status != "connected" || got.ListCount != 1 || got.Stopped != 1 {
		t.Errorf("status %q, list %d, stopped %d", got.Status, got.ListCount, got.Stopped)
	}
	if got.StatuslineRunning != "nook:ready running" || got.StatuslineIdle != "nook:ready" || got.StatuslineDrift != "nook:ready drift" || got.StatuslineStopped != "nook:stopped" {
		t.Errorf("statusline: running %q, idle %q, drift %q, stopped %q", got.StatuslineRunning, got.StatuslineIdle, got.StatuslineDrift, got.StatuslineStopped)
	}
	if !strings.Contains(got.Health, "OK: sandboxd answers") {
		t.Errorf(":checkhealth nook:\n%s", got.Health)
	}
}

package agent

import (
	"encoding/json"
	"testing"
)

// TestProcessListShowsEveryProcess: the list directive answers the records
// of every managed process, whoever started it, in key order.
func TestProcessListShowsEveryProcess(t *testing.T) {
	f := start(t)
	c := f.dial(t)
	directive(t, c, DirectiveProcessStart, map[string]any{"key": "web", "command": "exec sleep 60"})
	directive(t, c, DirectiveProcessStart, map[string]any{"key": "api", "command": "exec sleep 60"})
	directive(t, c, DirectiveProcessStop, keyReq{"web"})
	out, errOut, code := run(t, c, DirectiveProcessList, "")
	var list ProcessList
	if code != 0 || json.Unmarshal([]byte(out), &list) != nil {
		t.Fatalf("list: exit %d %q %q", code, out, errOut)
	}
	if len(list.Processes) != 2 || list.Processes[0].Key != "api" || list.Processes[0].Status != ProcessRunning || list.Processes[1].Key != "web" || list.Processes[1].Status != ProcessStopped {
		t.Fatalf("list: %+v", list.Processes)
	}
	directive(t, c, DirectiveProcessStop, keyReq{"api"})
}

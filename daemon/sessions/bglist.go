package sessions

import (
	"bytes"
	"context"
	"encoding/json"
	"sort"

	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/internal/helperproto"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// directiveProcessList asks the agent for every managed process of the run
// (localcloud's agent answers it; others run it as a command that is not
// found, exit 127).
const directiveProcessList = "__rwx_sandbox_process_list__"

// Bounds of the agent's process list: it comes from the sandbox.
const (
	maxListedProcesses = 256
	maxProcessListSize = 1 << 20
)

// agentProcesses returns the processes the agent runs for the run, whoever
// started them (nook or the RWX CLI: the agent's directives are the shared
// truth), by key; ok is false when the agent cannot list them (then only
// the names sandboxd recorded are known). The list is bounded in size and
// time like every process answer, and a record that is not a valid one
// (processRecord.validate) or whose key is not a process name is dropped.
func (m *Manager) agentProcesses(ctx context.Context, conn execer) (map[string]processRecord, bool) {
	ctx, cancel := context.WithTimeout(ctx, processDirectiveWait)
	defer cancel()
	out := newAnswer(maxProcessListSize)
	out.onOver = cancel
	st, err := conn.Exec(ctx, directiveProcessList, sshpool.Stdio{Stdout: out, Stderr: newAnswer(processErrorMax)})
	if err != nil || out.over || st.Code != 0 || st.Signal != "" {
		return nil, false
	}
	var list struct {
		Processes []processRecord `json:"processes"`
	}
	if json.Unmarshal(bytes.TrimSpace(out.Bytes()), &list) != nil || len(list.Processes) > maxListedProcesses {
		return nil, false
	}
	recs := make(map[string]processRecord, len(list.Processes))
	for _, r := range list.Processes {
		if r.Key == helperproto.ProcessKey {
			continue // sandboxd's own: neither the user's nor work that keeps a sandbox busy
		}
		if processName(r.Key) && r.validate(r.Key) == nil {
			recs[r.Key] = r
		}
	}
	return recs, true
}

// processName reports whether key is a valid process name (the RWX CLI's
// rule), the only form a name from the sandbox is used in.
func processName(key string) bool {
	if key == "" || len(key) > 255 {
		return false
	}
	for _, c := range key {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// othersProcesses are the listed processes sandboxd did not start, by name.
func (m *Manager) othersProcesses(s *store.Session, listed map[string]processRecord) []ipc.BgProcess {
	names := make([]string, 0, len(listed))
	for k := range listed {
		names = append(names, k)
	}
	sort.Strings(names)
	out := make([]ipc.BgProcess, 0, len(names))
	for _, k := range names {
		out = append(out, m.bgProcess(s, listed[k]))
	}
	return out
}

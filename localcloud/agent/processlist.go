package agent

import (
	"encoding/json"
	"sort"
)

// DirectiveProcessList answers {"processes":[record...]}: every managed
// process of the run, whoever started it (nook or the RWX CLI), so that each
// client lists the other's. Agents without it run it as a command, which
// is not found (exit 127): clients fall back to the names they know.
const DirectiveProcessList = "__rwx_sandbox_process_list__"

// ProcessList is the answer of DirectiveProcessList.
type ProcessList struct {
	Processes []ProcessRecord `json:"processes"`
}

// listProcesses returns the records of the run's managed processes, by key.
func (a *Agent) listProcesses() ProcessList {
	a.procs.mu.Lock()
	defer a.procs.mu.Unlock()
	out := ProcessList{Processes: make([]ProcessRecord, 0, len(a.procs.procs))}
	for _, p := range a.procs.procs {
		out.Processes = append(out.Processes, p.rec)
	}
	sort.Slice(out.Processes, func(i, j int) bool { return out.Processes[i].Key < out.Processes[j].Key })
	return out
}

// processListDirective answers DirectiveProcessList; false when command is
// another one.
func (s *session) processListDirective(command string) bool {
	if command != DirectiveProcessList {
		return false
	}
	out, _ := json.Marshal(s.conn.agent.listProcesses())
	_, _ = s.ch.Write(append(out, '\n'))
	s.exit(0)
	s.ch.Close()
	return true
}

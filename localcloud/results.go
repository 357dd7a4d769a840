package localcloud

import (
	"fmt"
	"net/http"
	"strings"

	"github.com/sandboxd/sandboxd/localcloud/runs"
	"github.com/sandboxd/sandboxd/rwxapi"
)

// The results endpoints are what the RWX CLI reads after a sandbox run
// completed before it became sandboxable: results/status until the run's
// polling is completed, then results/prompt, whose text it prints (the
// failed task and its output).

// resultRun finds the run a results call names: ?id=RUN, or ?run_id=RUN
// (with a task_key, which localcloud answers for the whole run).
func (s *Server) resultRun(r *http.Request, p principal) (runs.Run, error) {
	q := r.URL.Query()
	id := q.Get("id")
	if id == "" {
		id = q.Get("run_id")
	}
	if id == "" {
		return runs.Run{}, errorf(http.StatusBadRequest, "the id query parameter (the run id) is required")
	}
	if !runs.ValidID(id) {
		return runs.Run{}, errorf(http.StatusNotFound, "run %q not found", id)
	}
	if err := allow(p, id); err != nil {
		return runs.Run{}, err
	}
	return s.runs.Get(id)
}

// runResult is the RWX result of a completed run.
func runResult(run runs.Run) string {
	switch run.Reason {
	case runs.ReasonEnded:
		return "succeeded"
	case runs.ReasonCancelled, runs.ReasonTimedOut:
		return string(run.Reason)
	}
	return "failed"
}

func (s *Server) resultsStatus(w http.ResponseWriter, r *http.Request, p principal) error {
	run, err := s.resultRun(r, p)
	if err != nil {
		return err
	}
	res := rwxapi.RunStatusResult{RunID: run.ID, RunURL: s.runURL(run.ID), Polling: rwxapi.Polling{BackoffMs: 1000}}
	if run.State == runs.Completed {
		res.Polling = rwxapi.Polling{Completed: true}
		res.RunStatus = &rwxapi.RunResult{Result: runResult(run)}
	}
	return writeJSON(w, http.StatusOK, res)
}

func (s *Server) resultsPrompt(w http.ResponseWriter, r *http.Request, p principal) error {
	run, err := s.resultRun(r, p)
	if err != nil {
		return err
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(http.StatusOK)
	_, err = w.Write([]byte(runPrompt(run, s.runURL(run.ID))))
	return err
}

// runPrompt is the run's summary as text: for a failed setup step, the
// task, its exit and the end of its output, and what to change.
func runPrompt(run runs.Run, url string) string {
	var b strings.Builder
	state := string(run.State)
	if run.State == runs.Completed {
		state = runResult(run)
	}
	fmt.Fprintf(&b, "# Run %s: %s\n\nRun: %s\n", run.ID, state, url)
	if run.State != runs.Completed {
		return b.String()
	}
	if run.FailedTask == "" {
		fmt.Fprintf(&b, "\n%s\n", run.Ended())
		return b.String()
	}
	exit := run.Detail
	if i := strings.IndexByte(exit, '\n'); i >= 0 {
		exit = exit[:i]
	}
	fmt.Fprintf(&b, "\nFailed task: %s\n%s\n", run.FailedTask, exit)
	if run.FailedOutput != "" {
		fmt.Fprintf(&b, "\nOutput of %s (its last lines):\n```\n%s\n```\n", run.FailedTask, run.FailedOutput)
	}
	fmt.Fprintf(&b, "\nFix task %q in %s (it fails again as it is), then start the sandbox again.\n", run.FailedTask, run.ConfigPath)
	return b.String()
}

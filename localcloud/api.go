package localcloud

import (
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/sandboxd/sandboxd/rwxapi"

	"github.com/gorilla/mux"
	"github.com/sandboxd/sandboxd/localcloud/runs"
)

// maxBody bounds request bodies (the RWX CLI caps the .rwx directory at
// 5 MiB).
const maxBody = 16 << 20

// Token lifetimes of sandbox_tokens.
const (
	defaultTokenTTL = 24 * time.Hour
	maxTokenTTL     = 30 * 24 * time.Hour
)

// apiError is a handler error with its status.
type apiError struct {
	status int
	msg    string
}

func (e *apiError) Error() string { return e.msg }

func errorf(status int, format string, a ...any) error {
	return &apiError{status: status, msg: fmt.Sprintf(format, a...)}
}

// principal is who made a request: the owner (access token) or a client
// holding a token scoped to one run.
type principal struct {
	admin bool
	runID string
}

type handlerFunc func(w http.ResponseWriter, r *http.Request, p principal) error

func (s *Server) routes() http.Handler {
	r := mux.NewRouter()
	api := func(method, path string, h handlerFunc) {
		r.Handle(path, s.wrap(h, true)).Methods(method)
	}
	admin := func(method, path string, h handlerFunc) {
		r.Handle(path, s.wrap(func(w http.ResponseWriter, r *http.Request, p principal) error {
			if !p.admin {
				return errorf(http.StatusForbidden, "this endpoint needs the access token, not a scoped token")
			}
			return h(w, r, p)
		}, false)).Methods(method)
	}
	api(http.MethodPost, rwxapi.PathRuns, s.createRun)
	api(http.MethodGet, rwxapi.PathRuns, s.listRuns)
	api(http.MethodGet, rwxapi.PathRuns+"/{id}", s.getRun)
	api(http.MethodPost, rwxapi.PathRuns+"/{id}/cancel", s.cancelRun)
	api(http.MethodGet, rwxapi.PathConnectionInfo, s.connectionInfo)
	api(http.MethodPost, rwxapi.PathSandboxTokens, s.sandboxToken)
	api(http.MethodGet, rwxapi.PathInitTemplate, s.initTemplate)
	api(http.MethodGet, rwxapi.PathLeaves, s.leaves)
	api(http.MethodGet, rwxapi.PathBaseDefault, s.baseDefault)
	api(http.MethodGet, rwxapi.PathSkillLatest, s.skillLatest)
	api(http.MethodPost, rwxapi.PathTelemetry, s.telemetry)
	api(http.MethodGet, rwxapi.PathResultsStatus, s.resultsStatus)
	api(http.MethodGet, rwxapi.PathResultsPrompt, s.resultsPrompt)
	api(http.MethodGet, "/runs/{id}", s.getRun) // the run_url
	admin(http.MethodGet, "/localcloud/health", s.health)
	if s.cfg.EnableFaultInjection {
		admin(http.MethodGet, "/admin/faults", s.getFaults)
		admin(http.MethodPost, "/admin/faults", s.setFaults)
		admin(http.MethodPost, "/admin/runs/{id}/drop-connections", s.dropConnections)
		admin(http.MethodPost, "/admin/silence", s.setSilence)
	}
	admin(http.MethodPost, "/admin/sweep", s.sweep)
	admin(http.MethodGet, "/admin/runs/{id}/ssh-stats", s.sshStats)
	r.NotFoundHandler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeError(w, errorf(http.StatusNotFound, "no route for %s %s", r.Method, r.URL.Path))
	})
	r.MethodNotAllowedHandler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeError(w, errorf(http.StatusMethodNotAllowed, "method %s is not allowed on %s", r.Method, r.URL.Path))
	})
	return r
}

// wrap authenticates, applies injected faults (runs API only) and maps
// handler errors to JSON answers.
func (s *Server) wrap(h handlerFunc, faulty bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Localcloud-Version", s.cfg.Version)
		p, ok := s.authenticate(r)
		if !ok {
			writeError(w, errorf(http.StatusUnauthorized, "missing or invalid bearer token: send Authorization: Bearer <the access token in %s> or a token scoped to the run", s.TokenFile()))
			return
		}
		if faulty {
			s.apiRequests.Add(1)
			f := s.Faults()
			if f.LatencyMS > 0 {
				select {
				case <-time.After(time.Duration(f.LatencyMS) * time.Millisecond):
				case <-r.Context().Done():
					return
				}
			}
			if f.ErrorRate5xx > 0 && s.cfg.Rand() < f.ErrorRate5xx {
				writeError(w, errorf(http.StatusServiceUnavailable, "injected fault: service unavailable"))
				return
			}
		}
		r.Body = http.MaxBytesReader(w, r.Body, maxBody)
		if err := h(w, r, p); err != nil {
			writeError(w, err)
		}
	})
}

func (s *Server) authenticate(r *http.Request) (principal, bool) {
	token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	token = strings.TrimSpace(token)
	if !ok || token == "" {
		return principal{}, false
	}
	if subtle.ConstantTimeCompare([]byte(token), []byte(s.token)) == 1 {
		return principal{admin: true}, true
	}
	if id, ok := s.runs.TokenRun(token); ok {
		return principal{runID: id}, true
	}
	return principal{}, false
}

// allow checks that p may act on run id.
func allow(p principal, id string) error {
	if p.admin || p.runID == id {
		return nil
	}
	return errorf(http.StatusForbidden, "this token is scoped to another run")
}

func requireAccess(p principal) error {
	if p.admin {
		return nil
	}
	return errorf(http.StatusForbidden, "this call needs the access token, not a token scoped to one run")
}

func writeJSON(w http.ResponseWriter, status int, v any) error {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	return json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, err error) {
	status := http.StatusInternalServerError
	var ae *apiError
	var mbe *http.MaxBytesError
	switch {
	case errors.As(err, &ae):
		status = ae.status
	case errors.As(err, &mbe):
		status, err = http.StatusRequestEntityTooLarge, fmt.Errorf("request body is larger than %d bytes", mbe.Limit)
	case errors.Is(err, runs.ErrInvalid):
		status = http.StatusBadRequest
	case errors.Is(err, runs.ErrNotFound):
		status = http.StatusNotFound
	case errors.Is(err, runs.ErrGone):
		status = http.StatusGone
	case errors.Is(err, runs.ErrClosed):
		status = http.StatusServiceUnavailable
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(rwxapi.ErrorBody{Error: err.Error()})
}

// decode reads one JSON value; unknown fields are ignored (newer clients
// send more), wrong types and trailing data are 400, too large 413.
func decode(r *http.Request, v any) error {
	dec := json.NewDecoder(r.Body)
	if err := dec.Decode(v); err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return err
		}
		if errors.Is(err, io.EOF) {
			return errorf(http.StatusBadRequest, "the request body is empty: send a JSON object")
		}
		return errorf(http.StatusBadRequest, "malformed JSON body: %v", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errorf(http.StatusBadRequest, "malformed JSON body: unexpected data after the JSON object")
	}
	return nil
}

func (s *Server) runURL(id string) string { return s.APIURL() + "/runs/" + id }

func (s *Server) createRun(w http.ResponseWriter, r *http.Request, p principal) error {
	if err := requireAccess(p); err != nil {
		return err
	}
	var req rwxapi.CreateRunRequest
	if err := decode(r, &req); err != nil {
		return err
	}
	run, existing, err := s.runs.Create(runs.CreateRequest{Definition: req.Run, IdempotencyKey: r.Header.Get(rwxapi.HeaderIdempotencyKey)})
	if err != nil {
		return err
	}
	if existing {
		s.log.Info("create run: idempotent replay", "run", run.ID)
	}
	// 201 for a replay too: the RWX CLI accepts nothing else.
	return writeJSON(w, http.StatusCreated, rwxapi.CreateRunResult{RunID: run.ID, RunURL: s.runURL(run.ID)})
}

func (s *Server) listRuns(w http.ResponseWriter, r *http.Request, p principal) error {
	if err := requireAccess(p); err != nil {
		return err
	}
	q := r.URL.Query()
	states := map[runs.State]bool{runs.Provisioning: true, runs.Sandboxable: true, runs.Completed: true}
	keep := func(allowed ...runs.State) {
		for st := range states {
			if !contains(allowed, st) {
				delete(states, st)
			}
		}
	}
	var filter runs.Filter
	switch v := q.Get(rwxapi.QueryExecutionStatus); v {
	case "":
	case rwxapi.ExecutionStatusInProgress:
		keep(runs.Provisioning, runs.Sandboxable)
	case "finished", "completed":
		keep(runs.Completed)
	default:
		return errorf(http.StatusBadRequest, "execution_status %q is not supported: use in_progress or finished", v)
	}
	switch v := q.Get(rwxapi.QueryResultStatus); v {
	case "":
	case rwxapi.ResultStatusSandboxed:
		keep(runs.Sandboxable)
	case string(runs.ReasonEnded), string(runs.ReasonCancelled), string(runs.ReasonTimedOut), string(runs.ReasonFailed):
		keep(runs.Completed)
		filter.Reasons = []runs.Reason{runs.Reason(v)}
	default:
		return errorf(http.StatusBadRequest, "result_status %q is not supported: use sandboxed, ended, cancelled, timed_out or failed", v)
	}
	switch v := q.Get(rwxapi.QueryMyRuns); v {
	case "", "true", "false": // every run on this machine is the user's
	default:
		return errorf(http.StatusBadRequest, "my_runs %q must be true or false", v)
	}
	for st := range states {
		filter.States = append(filter.States, st)
	}
	res := rwxapi.ListRunsResult{Runs: []rwxapi.RunSummary{}}
	if len(filter.States) > 0 {
		for _, run := range s.runs.List(filter) {
			res.Runs = append(res.Runs, rwxapi.RunSummary{ID: run.ID, RunURL: s.runURL(run.ID), Title: run.Title, CLIState: run.CLIState})
		}
	}
	return writeJSON(w, http.StatusOK, res)
}

func contains[T comparable](xs []T, x T) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

// RunStatus is localcloud's own view of a run (GET /mint/api/runs/{id} and
// the run_url).
type RunStatus struct {
	ID            string             `json:"id"`
	RunURL        string             `json:"run_url"`
	Title         string             `json:"title"`
	State         runs.State         `json:"state"`
	Reason        runs.Reason        `json:"reason,omitempty"`
	Detail        string             `json:"detail,omitempty"`
	Git           rwxapi.GitMetadata `json:"git"`
	CLIState      string             `json:"cli_state,omitempty"`
	CreatedAt     time.Time          `json:"created_at"`
	SandboxableAt time.Time          `json:"sandboxable_at,omitzero"`
	CompletedAt   time.Time          `json:"completed_at,omitzero"`
	LastActivity  time.Time          `json:"last_activity_at,omitzero"`
	ExpiresAt     time.Time          `json:"expires_at"`
	IdleDeadline  time.Time          `json:"idle_deadline,omitzero"`
	AgentAddress  string             `json:"agent_address,omitempty"`
	Workspace     string             `json:"workspace"`
	LogFile       string             `json:"log_file"`
}

func (s *Server) runID(r *http.Request) (string, error) {
	id := mux.Vars(r)["id"]
	if !runs.ValidID(id) {
		return "", errorf(http.StatusNotFound, "run %q not found", id)
	}
	return id, nil
}

func (s *Server) getRun(w http.ResponseWriter, r *http.Request, p principal) error {
	id, err := s.runID(r)
	if err != nil {
		return err
	}
	if err := allow(p, id); err != nil {
		return err
	}
	run, err := s.runs.Get(id)
	if err != nil {
		return err
	}
	st := RunStatus{
		ID: run.ID, RunURL: s.runURL(run.ID), Title: run.Title, State: run.State, Reason: run.Reason, Detail: run.Detail,
		Git: run.Git, CLIState: run.CLIState, CreatedAt: run.CreatedAt, SandboxableAt: run.SandboxableAt, CompletedAt: run.CompletedAt,
		LastActivity: run.LastActivityAt, ExpiresAt: run.ExpiresAt, IdleDeadline: run.IdleDeadline(),
		Workspace: s.runs.Workspace(run.ID), LogFile: s.runs.LogFile(run.ID),
	}
	if run.State == runs.Sandboxable {
		st.AgentAddress = run.AgentAddr
	}
	return writeJSON(w, http.StatusOK, st)
}

func (s *Server) cancelRun(w http.ResponseWriter, r *http.Request, p principal) error {
	id, err := s.runID(r)
	if err != nil {
		return err
	}
	if err := allow(p, id); err != nil {
		return err
	}
	run, err := s.runs.Cancel(id)
	if err != nil {
		return err
	}
	return writeJSON(w, http.StatusOK, map[string]any{"run_id": run.ID, "state": run.State, "reason": run.Reason})
}

func (s *Server) connectionInfo(w http.ResponseWriter, r *http.Request, p principal) error {
	id := r.URL.Query().Get("sandbox_key")
	if id == "" {
		return errorf(http.StatusBadRequest, "the sandbox_key query parameter (the run id) is required")
	}
	if !runs.ValidID(id) {
		return errorf(http.StatusNotFound, "run %q not found", id)
	}
	if err := allow(p, id); err != nil {
		return err
	}
	ci, err := s.runs.ConnectionInfo(id)
	if err != nil {
		return err
	}
	return writeJSON(w, http.StatusOK, ci)
}

func (s *Server) sandboxToken(w http.ResponseWriter, r *http.Request, p principal) error {
	var req rwxapi.SandboxTokenRequest
	if err := decode(r, &req); err != nil {
		return err
	}
	if req.RunID == "" {
		return errorf(http.StatusBadRequest, "run_id is required")
	}
	if !runs.ValidID(req.RunID) {
		return errorf(http.StatusNotFound, "run %q not found", req.RunID)
	}
	if err := allow(p, req.RunID); err != nil {
		return err
	}
	ttl := time.Duration(req.ExpiresInSeconds) * time.Second
	switch {
	case req.ExpiresInSeconds == 0:
		ttl = defaultTokenTTL
	case req.ExpiresInSeconds < 0 || ttl > maxTokenTTL:
		return errorf(http.StatusBadRequest, "expires_in_seconds %d is out of range 1..%d", req.ExpiresInSeconds, int64(maxTokenTTL/time.Second))
	}
	run, err := s.runs.Get(req.RunID)
	if err != nil {
		return err
	}
	if run.State == runs.Completed {
		return fmt.Errorf("%w: run %s %s", runs.ErrGone, run.ID, run.Ended())
	}
	token, exp, err := s.runs.IssueToken(req.RunID, ttl)
	if err != nil {
		return err
	}
	return writeJSON(w, http.StatusCreated, rwxapi.SandboxToken{Token: token, ExpiresAt: exp.Format(time.RFC3339), RunID: req.RunID})
}

// InitTemplate is the .rwx/sandbox.yml localcloud suggests. It carries a
// base so that the RWX CLI does not rewrite it, and stays a valid RWX Cloud
// config.
const InitTemplate = `# Sandbox configuration (rwx sandbox / nook).
#
# On sandboxd-localcloud the repository is cloned from its origin at the
# commit you are on; the tasks with a ` + "`run:`" + ` before the sandbox task run
# in order in the checkout, then the sandbox is ready.
base:
  image: ubuntu:24.04
  config: rwx/base 1.0.0

tasks:
  - key: code
    call: git/clone 1.9.0
    with:
      repository: ${{ init.repository }}
      ref: ${{ init.ref }}

  # - key: deps
  #   use: code
  #   run: make deps

  - key: sandbox
    use: code
    run: rwx-sandbox
`

func (s *Server) initTemplate(w http.ResponseWriter, r *http.Request, p principal) error {
	return writeJSON(w, http.StatusOK, rwxapi.InitTemplateResult{Template: InitTemplate})
}

func (s *Server) leaves(w http.ResponseWriter, r *http.Request, p principal) error {
	// No package registry here: a valid, empty answer.
	return writeJSON(w, http.StatusOK, map[string]any{"renames": map[string]string{}, "latest_major": map[string]string{}, "latest_minor": map[string]any{}, "packages": map[string]any{}})
}

// The base the RWX CLI writes into configs that have none: localcloud runs
// on the host and ignores it, so the config stays valid for RWX Cloud.
func (s *Server) baseDefault(w http.ResponseWriter, r *http.Request, p principal) error {
	return writeJSON(w, http.StatusOK, map[string]string{"image": "ubuntu:24.04", "config": "rwx/base 1.0.0", "arch": "x86_64"})
}

func (s *Server) skillLatest(w http.ResponseWriter, r *http.Request, p principal) error {
	return errorf(http.StatusNotFound, "localcloud publishes no agent skill")
}

func (s *Server) telemetry(w http.ResponseWriter, r *http.Request, p principal) error {
	_, _ = io.Copy(io.Discard, r.Body) // accepted and dropped
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// Health is the answer of GET /localcloud/health.
type Health struct {
	PID       int       `json:"pid"`
	Version   string    `json:"version"`
	StartedAt time.Time `json:"started_at"`
	Runs      int       `json:"runs"`
	// APIRequests counts the runs API requests served since the start.
	APIRequests int64 `json:"api_requests"`
}

func (s *Server) health(w http.ResponseWriter, r *http.Request, p principal) error {
	return writeJSON(w, http.StatusOK, Health{PID: os.Getpid(), Version: s.cfg.Version, StartedAt: s.started, Runs: len(s.runs.List(runs.Filter{})), APIRequests: s.apiRequests.Load()})
}

func (s *Server) getFaults(w http.ResponseWriter, r *http.Request, p principal) error {
	return writeJSON(w, http.StatusOK, s.Faults())
}

// setFaults changes only the fields present in the body.
func (s *Server) setFaults(w http.ResponseWriter, r *http.Request, p principal) error {
	var req struct {
		LatencyMS    *int64   `json:"latency_ms"`
		ErrorRate5xx *float64 `json:"error_rate_5xx"`
		DropSSH      *bool    `json:"drop_ssh"`
		OneWayDelay  *int64   `json:"one_way_delay_ms"`
	}
	if err := decode(r, &req); err != nil {
		return err
	}
	f := s.Faults()
	if req.LatencyMS != nil {
		f.LatencyMS = *req.LatencyMS
	}
	if req.ErrorRate5xx != nil {
		f.ErrorRate5xx = *req.ErrorRate5xx
	}
	if req.DropSSH != nil {
		f.DropSSH = *req.DropSSH
	}
	if req.OneWayDelay != nil {
		f.OneWayDelayMS = *req.OneWayDelay
	}
	if err := s.SetFaults(f); err != nil {
		return errorf(http.StatusBadRequest, "%v", err)
	}
	return writeJSON(w, http.StatusOK, f)
}

func (s *Server) dropConnections(w http.ResponseWriter, r *http.Request, p principal) error {
	id, err := s.runID(r)
	if err != nil {
		return err
	}
	n, err := s.runs.DropConnections(id)
	if err != nil {
		return err
	}
	return writeJSON(w, http.StatusOK, map[string]int{"dropped": n})
}

// sshStats is GET /admin/runs/{id}/ssh-stats: connections, channel opens
// and exec requests of the run's agent, in total and per connection
// (agent.Stats).
func (s *Server) sshStats(w http.ResponseWriter, r *http.Request, p principal) error {
	id, err := s.runID(r)
	if err != nil {
		return err
	}
	st, err := s.runs.SSHStats(id)
	if err != nil {
		return err
	}
	return writeJSON(w, http.StatusOK, st)
}

func (s *Server) sweep(w http.ResponseWriter, r *http.Request, p principal) error {
	s.runs.Sweep()
	return writeJSON(w, http.StatusOK, map[string]bool{"swept": true})
}

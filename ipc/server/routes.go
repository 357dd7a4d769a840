package server

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"net/http"
	"os"
	"runtime"
	"strings"

	"github.com/gorilla/mux"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// Route paths.
const (
	routeVersion   = "/v1/version"
	routeHealth    = "/v1/health"
	routeStop      = "/v1/daemon/stop"
	routeConfig    = "/v1/config"
	routeStart     = "/v1/sessions/start"
	routeReset     = "/v1/sessions/reset"
	routeSessions  = "/v1/sessions"
	routeStopSess  = "/v1/sessions/stop"
	routePrune     = "/v1/sessions/prune"
	routeKeep      = "/v1/sessions/keep"
	routeProbe     = "/v1/sessions/{id}/probe"
	routeStatus    = "/v1/status"
	routeInit      = "/v1/init"
	routeReconcile = "/v1/reconcile"
	routeExec      = "/v1/exec"
	routePush      = "/v1/push"
	routePull      = "/v1/pull"
	routeEvents    = "/v1/events"
	routeOpenAPI   = "/v1/openapi.yaml"
	routeDoctor    = "/v1/doctor"
	routeSSHHosts  = "/v1/ssh/hosts"
	routeSSHProxy  = "/v1/ssh/proxy"
	routeBg        = "/v1/bg"
	routeBgStart   = "/v1/bg/start"
	routeBgRestart = "/v1/bg/restart"
	routeBgStop    = "/v1/bg/stop"
	routeBgLogs    = "/v1/bg/logs"
	routeBgForward = "/v1/bg/forward"
)

//go:embed openapi.yaml
var openAPIDocument []byte

// OpenAPI returns the OpenAPI 3 document of the socket API.
func OpenAPI() []byte { return append([]byte(nil), openAPIDocument...) }

func (s *Server) routes() *mux.Router {
	r := mux.NewRouter()
	r.NotFoundHandler = s.serveAPI(func(w http.ResponseWriter, r *http.Request) error {
		return errdefs.NotFoundf("no route %s %s: the API is described by GET /v1/openapi.yaml", r.Method, r.URL.Path)
	})
	r.MethodNotAllowedHandler = s.serveAPI(func(w http.ResponseWriter, r *http.Request) error {
		return &errdefs.Error{Kind: errdefs.KindMethod, Err: fmt.Errorf("method %s is not allowed on %s: the API is described by GET /v1/openapi.yaml", r.Method, r.URL.Path)}
	})
	handle := func(method, path string, fn apiFunc) {
		r.Handle(path, s.serveAPI(fn)).Methods(method)
	}
	handle(http.MethodGet, routeVersion, s.getVersion)
	handle(http.MethodGet, routeOpenAPI, s.getOpenAPI)
	handle(http.MethodGet, routeHealth, route(s.daemon, noInput, withoutInput(DaemonBackend.Health), http.StatusOK))
	handle(http.MethodPost, routeStop, route(s.daemon, emptyBody, stopDaemon, http.StatusAccepted))
	handle(http.MethodGet, routeConfig, route(s.sessions, noInput, withoutInput(SessionBackend.Config), http.StatusOK))
	handle(http.MethodGet, routeDoctor, route(s.sessions, noInput, withoutInput(SessionBackend.Doctor), http.StatusOK))
	handle(http.MethodPost, routeStart, routeWithStatus(s.sessions, jsonBody[ipc.StartRequest], SessionBackend.Start, startStatus))
	handle(http.MethodPost, routeReset, routeWithStatus(s.sessions, jsonBody[ipc.StartRequest], SessionBackend.Reset, startStatus))
	handle(http.MethodGet, routeSessions, route(s.sessions, listQuery, listSessions, http.StatusOK))
	handle(http.MethodPost, routeStopSess, route(s.sessions, jsonBody[ipc.StopRequest], stopSessions, http.StatusOK))
	handle(http.MethodPost, routePrune, route(s.pruner, jsonBody[ipc.PruneRequest], pruneSessions, http.StatusOK))
	handle(http.MethodPost, routeKeep, route(s.keeper, jsonBody[ipc.KeepRequest], Keeper.Keep, http.StatusOK))
	handle(http.MethodGet, routeProbe, route(s.sessions, probeID, SessionBackend.Probe, http.StatusOK))
	handle(http.MethodGet, routeStatus, route(s.sessions, statusQuery, SessionBackend.Status, http.StatusOK))
	handle(http.MethodPost, routeInit, route(s.sessions, jsonBody[ipc.InitRequest], SessionBackend.Init, http.StatusCreated))
	handle(http.MethodPost, routeReconcile, route(s.sessions, emptyBody, reconcile, http.StatusOK))
	handle(http.MethodPost, routeExec, s.postExec)
	handle(http.MethodPost, routePush, route(s.sessions, jsonBody[ipc.PushRequest], SessionBackend.Push, http.StatusOK))
	handle(http.MethodPost, routePull, route(s.sessions, jsonBody[ipc.PullRequest], SessionBackend.Pull, http.StatusOK))
	handle(http.MethodGet, routeEvents, s.getEvents)
	handle(http.MethodGet, routeBg, route(s.background, bgListQuery, listBg, http.StatusOK))
	handle(http.MethodPost, routeBgStart, route(s.background, jsonBody[ipc.BgStartRequest], BackgroundBackend.BgStart, http.StatusOK))
	handle(http.MethodPost, routeBgRestart, route(s.background, jsonBody[ipc.BgRequest], BackgroundBackend.BgRestart, http.StatusOK))
	handle(http.MethodPost, routeBgStop, route(s.background, jsonBody[ipc.BgRequest], BackgroundBackend.BgStop, http.StatusOK))
	handle(http.MethodPost, routeBgLogs, s.postBgLogs)
	handle(http.MethodPost, routeBgForward, route(s.forwarder, jsonBody[ipc.BgForwardRequest], BackgroundForwarder.BgForward, http.StatusOK))
	handle(http.MethodGet, routeSSHHosts, route(s.sshBackend, noInput, getSSHHosts, http.StatusOK))
	handle(http.MethodPost, routeSSHProxy, s.postSSHProxy)
	return r
}

// route is the shape of every plain JSON route: read the request (query,
// body, validation), then get the backend, call it and answer its response
// as JSON with status. The order matters: a malformed request is a 400 even
// while the backend is unavailable (503).
func route[B, Req, Resp any](
	backend func() (B, error),
	read func(*http.Request) (Req, error),
	call func(B, context.Context, Req) (Resp, error),
	status int,
) apiFunc {
	return routeWithStatus(backend, read, call, func(Resp) int { return status })
}

// routeWithStatus is route for a route whose status depends on the response.
func routeWithStatus[B, Req, Resp any](
	backend func() (B, error),
	read func(*http.Request) (Req, error),
	call func(B, context.Context, Req) (Resp, error),
	statusOf func(Resp) int,
) apiFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		req, err := read(r)
		if err != nil {
			return err
		}
		b, err := backend()
		if err != nil {
			return err
		}
		resp, err := call(b, r.Context(), req)
		if err != nil {
			return err
		}
		writeJSON(w, statusOf(resp), resp)
		return nil
	}
}

// startStatus is 201 when start or reset created the session, 200 when it
// was already there.
func startStatus(resp ipc.StartResponse) int {
	if resp.Created {
		return http.StatusCreated
	}
	return http.StatusOK
}

// withoutInput adapts a backend call that takes no request to route.
func withoutInput[B, Resp any](call func(B, context.Context) (Resp, error)) func(B, context.Context, struct{}) (Resp, error) {
	return func(b B, ctx context.Context, _ struct{}) (Resp, error) { return call(b, ctx) }
}

// noQuery refuses query parameters on routes that take none.
func noQuery(r *http.Request) error { return newQuery(r).done() }

// noInput reads a route that takes neither query parameters nor a body.
func noInput(r *http.Request) (struct{}, error) { return struct{}{}, noQuery(r) }

// emptyBody reads a route whose body, if any, must be an empty JSON object.
func emptyBody(r *http.Request) (struct{}, error) {
	if err := noQuery(r); err != nil {
		return struct{}{}, err
	}
	return struct{}{}, decodeBody(r, &struct{}{}, true)
}

// jsonBody reads a route that takes no query parameters and a required JSON
// body of type Req, which it validates (and so normalises).
func jsonBody[Req any, PReq interface {
	*Req
	Validate() error
}](r *http.Request) (Req, error) {
	var req Req
	if err := noQuery(r); err != nil {
		return req, err
	}
	if err := decodeBody(r, &req, false); err != nil {
		return req, err
	}
	if err := PReq(&req).Validate(); err != nil {
		return req, err
	}
	return req, nil
}

func listQuery(r *http.Request) (ipc.ListRequest, error) {
	q := newQuery(r)
	req := ipc.ListRequest{All: q.boolean("all")}
	return req, q.done()
}

func statusQuery(r *http.Request) (ipc.StatusRequest, error) {
	q := newQuery(r)
	req := ipc.StatusRequest{Cwd: q.str("cwd"), ConfigFile: q.str("configFile"), RunID: q.str("runId")}
	if err := q.done(); err != nil {
		return req, err
	}
	if err := req.Validate(); err != nil {
		return req, err
	}
	return req, nil
}

func probeID(r *http.Request) (string, error) {
	if err := noQuery(r); err != nil {
		return "", err
	}
	id := mux.Vars(r)["id"]
	if strings.TrimSpace(id) == "" {
		return "", errdefs.Invalidf("the session id in the path is empty")
	}
	return id, nil
}

func stopDaemon(d DaemonBackend, ctx context.Context, _ struct{}) (ipc.DaemonStopResponse, error) {
	if err := d.Shutdown(ctx); err != nil {
		return ipc.DaemonStopResponse{}, err
	}
	return ipc.DaemonStopResponse{Status: "stopping"}, nil
}

func reconcile(b SessionBackend, ctx context.Context, _ struct{}) (ipc.ReconcileResponse, error) {
	if err := b.Reconcile(ctx); err != nil {
		return ipc.ReconcileResponse{}, err
	}
	return ipc.ReconcileResponse{Status: "ok"}, nil
}

// listSessions and stopSessions answer [] rather than null for no sessions.
func listSessions(b SessionBackend, ctx context.Context, req ipc.ListRequest) (ipc.ListResponse, error) {
	resp, err := b.List(ctx, req)
	if err == nil && resp.Sessions == nil {
		resp.Sessions = []ipc.SessionInfo{}
	}
	return resp, err
}

func stopSessions(b SessionBackend, ctx context.Context, req ipc.StopRequest) (ipc.StopResponse, error) {
	resp, err := b.Stop(ctx, req)
	if err == nil && resp.Stopped == nil {
		resp.Stopped = []ipc.SessionInfo{}
	}
	return resp, err
}

func (s *Server) getVersion(w http.ResponseWriter, r *http.Request) error {
	if err := noQuery(r); err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, ipc.VersionResponse{Version: s.version, GoVersion: runtime.Version(), PID: os.Getpid(), StartedAt: s.startedAt})
	return nil
}

func (s *Server) getOpenAPI(w http.ResponseWriter, r *http.Request) error {
	if err := noQuery(r); err != nil {
		return err
	}
	w.Header().Set("Content-Type", "application/yaml")
	_, _ = w.Write(openAPIDocument)
	return nil
}

func (s *Server) daemon() (DaemonBackend, error) {
	if s.b.Daemon == nil {
		return nil, errdefs.Unavailable(errors.New("the daemon backend is not available in this server"))
	}
	return s.b.Daemon, nil
}

func (s *Server) sessions() (SessionBackend, error) {
	if s.b.Sessions == nil {
		return nil, errdefs.Unavailable(errors.New("sessions are not available: the daemon has not finished starting (or failed to); see `nook daemon status` and the daemon's log"))
	}
	return s.b.Sessions, nil
}

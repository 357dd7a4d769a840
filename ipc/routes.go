package ipc

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/gorilla/mux"

	"github.com/sandboxd/sandboxd/ipc/errdefs"
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
	routeProbe     = "/v1/sessions/{id}/probe"
	routeStatus    = "/v1/status"
	routeInit      = "/v1/init"
	routeReconcile = "/v1/reconcile"
	routeExec      = "/v1/exec"
	routeEvents    = "/v1/events"
	routeOpenAPI   = "/v1/openapi.yaml"
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
	handle(http.MethodGet, routeHealth, s.getHealth)
	handle(http.MethodPost, routeStop, s.postDaemonStop)
	handle(http.MethodGet, routeOpenAPI, s.getOpenAPI)
	handle(http.MethodGet, routeConfig, s.getConfig)
	handle(http.MethodPost, routeStart, s.postStart)
	handle(http.MethodPost, routeReset, s.postReset)
	handle(http.MethodGet, routeSessions, s.getSessions)
	handle(http.MethodPost, routeStopSess, s.postStopSessions)
	handle(http.MethodGet, routeProbe, s.getProbe)
	handle(http.MethodGet, routeStatus, s.getStatus)
	handle(http.MethodPost, routeInit, s.postInit)
	handle(http.MethodPost, routeReconcile, s.postReconcile)
	handle(http.MethodPost, routeExec, s.postExec)
	handle(http.MethodGet, routeEvents, s.getEvents)
	return r
}

// noQuery refuses query parameters on routes that take none.
func noQuery(r *http.Request) error { return newQuery(r).done() }

func (s *Server) getVersion(w http.ResponseWriter, r *http.Request) error {
	if err := noQuery(r); err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, VersionResponse{Version: s.version, GoVersion: runtime.Version(), PID: os.Getpid(), StartedAt: s.startedAt})
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
		return nil, errdefs.Unavailable(errors.New("sessions are not available: the daemon has not finished starting (or failed to); see `sbx daemon status` and the daemon's log"))
	}
	return s.b.Sessions, nil
}

func (s *Server) getHealth(w http.ResponseWriter, r *http.Request) error {
	if err := noQuery(r); err != nil {
		return err
	}
	d, err := s.daemon()
	if err != nil {
		return err
	}
	h, err := d.Health(r.Context())
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, h)
	return nil
}

func (s *Server) postDaemonStop(w http.ResponseWriter, r *http.Request) error {
	if err := noQuery(r); err != nil {
		return err
	}
	if err := decodeBody(r, &struct{}{}, true); err != nil {
		return err
	}
	d, err := s.daemon()
	if err != nil {
		return err
	}
	if err := d.Shutdown(r.Context()); err != nil {
		return err
	}
	writeJSON(w, http.StatusAccepted, DaemonStopResponse{Status: "stopping"})
	return nil
}

func (s *Server) getConfig(w http.ResponseWriter, r *http.Request) error {
	if err := noQuery(r); err != nil {
		return err
	}
	b, err := s.sessions()
	if err != nil {
		return err
	}
	resp, err := b.Config(r.Context())
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, resp)
	return nil
}

func (s *Server) postStart(w http.ResponseWriter, r *http.Request) error {
	return s.start(w, r, SessionBackend.Start)
}

func (s *Server) postReset(w http.ResponseWriter, r *http.Request) error {
	return s.start(w, r, SessionBackend.Reset)
}

func (s *Server) start(w http.ResponseWriter, r *http.Request, op func(SessionBackend, context.Context, StartRequest) (StartResponse, error)) error {
	if err := noQuery(r); err != nil {
		return err
	}
	var req StartRequest
	if err := decodeBody(r, &req, false); err != nil {
		return err
	}
	if err := req.Validate(); err != nil {
		return err
	}
	b, err := s.sessions()
	if err != nil {
		return err
	}
	resp, err := op(b, r.Context(), req)
	if err != nil {
		return err
	}
	status := http.StatusOK
	if resp.Created {
		status = http.StatusCreated
	}
	writeJSON(w, status, resp)
	return nil
}

func (s *Server) getSessions(w http.ResponseWriter, r *http.Request) error {
	q := newQuery(r)
	req := ListRequest{All: q.boolean("all")}
	if err := q.done(); err != nil {
		return err
	}
	b, err := s.sessions()
	if err != nil {
		return err
	}
	resp, err := b.List(r.Context(), req)
	if err != nil {
		return err
	}
	if resp.Sessions == nil {
		resp.Sessions = []SessionInfo{}
	}
	writeJSON(w, http.StatusOK, resp)
	return nil
}

func (s *Server) postStopSessions(w http.ResponseWriter, r *http.Request) error {
	if err := noQuery(r); err != nil {
		return err
	}
	var req StopRequest
	if err := decodeBody(r, &req, false); err != nil {
		return err
	}
	if err := req.Validate(); err != nil {
		return err
	}
	b, err := s.sessions()
	if err != nil {
		return err
	}
	resp, err := b.Stop(r.Context(), req)
	if err != nil {
		return err
	}
	if resp.Stopped == nil {
		resp.Stopped = []SessionInfo{}
	}
	writeJSON(w, http.StatusOK, resp)
	return nil
}

func (s *Server) getProbe(w http.ResponseWriter, r *http.Request) error {
	if err := noQuery(r); err != nil {
		return err
	}
	id := mux.Vars(r)["id"]
	if strings.TrimSpace(id) == "" {
		return errdefs.Invalidf("the session id in the path is empty")
	}
	b, err := s.sessions()
	if err != nil {
		return err
	}
	resp, err := b.Probe(r.Context(), id)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, resp)
	return nil
}

func (s *Server) getStatus(w http.ResponseWriter, r *http.Request) error {
	q := newQuery(r)
	req := StatusRequest{Cwd: q.str("cwd"), ConfigFile: q.str("configFile"), RunID: q.str("runId")}
	if err := q.done(); err != nil {
		return err
	}
	if err := req.Validate(); err != nil {
		return err
	}
	b, err := s.sessions()
	if err != nil {
		return err
	}
	resp, err := b.Status(r.Context(), req)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, resp)
	return nil
}

func (s *Server) postInit(w http.ResponseWriter, r *http.Request) error {
	if err := noQuery(r); err != nil {
		return err
	}
	var req InitRequest
	if err := decodeBody(r, &req, false); err != nil {
		return err
	}
	if err := req.Validate(); err != nil {
		return err
	}
	b, err := s.sessions()
	if err != nil {
		return err
	}
	resp, err := b.Init(r.Context(), req)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, resp)
	return nil
}

func (s *Server) postReconcile(w http.ResponseWriter, r *http.Request) error {
	if err := noQuery(r); err != nil {
		return err
	}
	if err := decodeBody(r, &struct{}{}, true); err != nil {
		return err
	}
	b, err := s.sessions()
	if err != nil {
		return err
	}
	if err := b.Reconcile(r.Context()); err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, ReconcileResponse{Status: "ok"})
	return nil
}

// cleanAbs is filepath.Clean for a path that must be absolute.
func cleanAbs(what, p string) (string, error) {
	if !filepath.IsAbs(p) {
		return "", errdefs.Invalidf("%s %q is not an absolute path: send the absolute path", what, p)
	}
	return filepath.Clean(p), nil
}

// Package backend is what the socket API serves: the interfaces the daemon's
// parts implement (sessions, exec with its streams, signals and resizes,
// events, SSH access, the daemon process) and ipc/server calls. The daemon
// imports it, not the server, so that its domain does not depend on the
// transport.
package backend

import (
	"context"
	"io"
	"net"

	"github.com/sandboxd/sandboxd/ipc"
)

// SessionBackend is what the daemon's session manager provides to the socket
// API. Errors carry errdefs kinds; the server maps them to status codes.
type SessionBackend interface {
	Start(ctx context.Context, req ipc.StartRequest) (ipc.StartResponse, error)
	Reset(ctx context.Context, req ipc.StartRequest) (ipc.StartResponse, error)
	List(ctx context.Context, req ipc.ListRequest) (ipc.ListResponse, error)
	Stop(ctx context.Context, req ipc.StopRequest) (ipc.StopResponse, error)
	Init(ctx context.Context, req ipc.InitRequest) (ipc.InitResponse, error)
	Status(ctx context.Context, req ipc.StatusRequest) (ipc.ProbeResponse, error)
	Probe(ctx context.Context, sessionID string) (ipc.ProbeResponse, error)
	Config(ctx context.Context) (ipc.ConfigResponse, error)
	// Doctor checks the remote and each live sandbox (GET /v1/doctor).
	Doctor(ctx context.Context) (ipc.DoctorResponse, error)
	// Reconcile runs a reconcile pass, or joins the one in flight
	// (POST /v1/reconcile).
	Reconcile(ctx context.Context) error
	// Exec runs one command. ctx ends when the client goes away (which
	// must cancel a queued or running command) or the server shuts down.
	Exec(ctx context.Context, req ipc.ExecRequest, stream ExecStream) (ipc.ExecResult, error)
	// Push syncs the caller's working tree to its sandbox without running
	// a command (POST /v1/push).
	Push(ctx context.Context, req ipc.PushRequest) (ipc.PushResponse, error)
	// Pull brings the edits the caller's sandbox holds back into its
	// checkout now.
	Pull(ctx context.Context, req ipc.PullRequest) (ipc.PullResponse, error)
}

// ExecStream is the daemon's view of one exec call's streams. All methods are
// safe for concurrent use.
type ExecStream interface {
	// Stdin yields the bytes of stdin frames; io.EOF at stdinEof or at the
	// end of the request body. It is an empty reader when !req.Stdin.
	Stdin() io.Reader
	// Stdout and Stderr turn each Write into one frame, flushed at once.
	// Writes fail once the client has gone or the call has returned.
	Stdout() io.Writer
	Stderr() io.Writer
	// Signals yields signal names ("INT", "TERM", ...) from signal frames.
	// It is closed when the request body ends.
	Signals() <-chan string
	// Send writes a queued, started or warning frame.
	Send(ipc.ExecOutput) error
}

// ExecResizer is implemented by exec streams that carry resize frames (an
// exec with a TTY).
type ExecResizer interface {
	// Resizes yields the caller's new terminal sizes; closed when the
	// request body ends.
	Resizes() <-chan ipc.WindowSize
}

// EventSource is the daemon's event bus as the socket API sees it.
type EventSource interface {
	// Subscribe streams events after since (nil: only new ones). The
	// subscription ends when ctx ends or the daemon drops it (slow consumer,
	// gap); Err says why.
	Subscribe(ctx context.Context, since *uint64) (EventSubscription, error)
}

// EventSubscription is one subscriber's view of the event bus.
type EventSubscription interface {
	// Events is closed when the subscription ends.
	Events() <-chan ipc.Event
	// Err says why the subscription ended: nil while it runs or when the
	// subscriber closed it.
	Err() error
	Close()
}

// DaemonBackend is the daemon process itself.
type DaemonBackend interface {
	Health(ctx context.Context) (ipc.HealthResponse, error)
	// Shutdown begins an orderly shutdown (POST /v1/daemon/stop) and
	// returns at once: the shutdown itself waits for in-flight requests,
	// including the one that asked for it.
	Shutdown(ctx context.Context) error
}

// Backends are the parts of the daemon behind the socket API. A nil Sessions
// or Events answers 503 on its routes.
type Backends struct {
	Daemon   DaemonBackend
	Sessions SessionBackend
	Events   EventSource
	SSH      SSHBackend
}

// SSHBackend gives OpenSSH (and what runs over it: scp, rsync, git,
// editors' Remote-SSH) a way to the sandboxes through the daemon.
type SSHBackend interface {
	// SSHHosts writes the files OpenSSH needs for each live sandbox (its
	// pinned host key, its user key, 0600 under the daemon's state
	// directory) and describes them.
	SSHHosts(ctx context.Context) (ipc.SSHHostsResponse, error)
	// DialSSH connects to the SSH server of the sandbox req names.
	DialSSH(ctx context.Context, req ipc.SSHProxyRequest) (net.Conn, error)
}

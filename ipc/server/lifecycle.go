package server

import (
	"context"
	"errors"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// Pruner ends and forgets sessions whose checkout is gone or whose run
// ended (POST /v1/sessions/prune). The session backend provides it when it
// can, so fakes need not.
type Pruner interface {
	Prune(ctx context.Context, req ipc.PruneRequest) (ipc.PruneResponse, error)
}

func (s *Server) pruner() (Pruner, error) {
	b, err := s.sessions()
	if err != nil {
		return nil, err
	}
	p, ok := b.(Pruner)
	if !ok {
		return nil, errdefs.Unavailable(errors.New("pruning sessions is not available in this daemon"))
	}
	return p, nil
}

func pruneSessions(p Pruner, ctx context.Context, req ipc.PruneRequest) (ipc.PruneResponse, error) {
	resp, err := p.Prune(ctx, req)
	if err == nil && resp.Pruned == nil {
		resp.Pruned = []ipc.PrunedSession{}
	}
	return resp, err
}

// Keeper pins a sandbox against the idle stop (POST /v1/sessions/keep).
type Keeper interface {
	Keep(ctx context.Context, req ipc.KeepRequest) (ipc.KeepResponse, error)
}

func (s *Server) keeper() (Keeper, error) {
	b, err := s.sessions()
	if err != nil {
		return nil, err
	}
	k, ok := b.(Keeper)
	if !ok {
		return nil, errdefs.Unavailable(errors.New("keeping sandboxes is not available in this daemon"))
	}
	return k, nil
}

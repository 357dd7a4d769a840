package mcp

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/sandboxd/sandboxd/ipc"
)

// confinement is the repository root the server's calls must stay in, ""
// for none.
func confinement(opts Options) string {
	if opts.AnyCheckout {
		return ""
	}
	if opts.Checkout != "" {
		if root, ok := checkoutOf(opts.Checkout); ok {
			return root
		}
		// Not a checkout: every call is refused, saying so.
		return realPath(opts.Checkout)
	}
	if root, ok := checkoutOf(opts.Dir); ok {
		return root
	}
	return ""
}

// checkoutOf is the root of the git checkout holding dir (the nearest
// directory with a .git entry), symlinks resolved.
func checkoutOf(dir string) (string, bool) {
	if dir == "" {
		return "", false
	}
	d := realPath(dir)
	for {
		if _, err := os.Lstat(filepath.Join(d, ".git")); err == nil {
			return d, true
		}
		parent := filepath.Dir(d)
		if parent == d {
			return "", false
		}
		d = parent
	}
}

func realPath(p string) string {
	p = filepath.Clean(p)
	if real, err := filepath.EvalSymlinks(p); err == nil {
		return real
	}
	return p
}

func sameDir(a, b string) bool { return a != "" && realPath(a) == realPath(b) }

// allowed refuses a target outside the checkout the server is confined
// to: a cwd in another checkout (or in none), or a run whose session is
// not this checkout's.
func (h *handlers) allowed(ctx context.Context, t ipc.Target) error {
	if h.confined == "" {
		return nil
	}
	if t.RunID != "" {
		// A run's checkout never changes: one list per run id.
		if _, ok := h.runsInCheckout.Load(t.RunID); ok {
			return nil
		}
		resp, err := h.opts.Client.List(ctx, ipc.ListRequest{All: true})
		if err != nil {
			return fmt.Errorf("check that run %s is a sandbox of %s: %w", t.RunID, h.confined, err)
		}
		for _, s := range resp.Sessions {
			if s.RunID == t.RunID && sameDir(s.RepoRoot, h.confined) {
				h.runsInCheckout.Store(t.RunID, true)
				return nil
			}
		}
		return h.outside(fmt.Sprintf("run %s", t.RunID))
	}
	if root, ok := checkoutOf(t.Cwd); ok && root == h.confined {
		return nil
	}
	return h.outside(fmt.Sprintf("cwd %s", t.Cwd))
}

func (h *handlers) outside(what string) error {
	return fmt.Errorf("%s is outside the checkout %s this server is confined to: name a directory inside it, "+
		"or start the server with --any-checkout to reach every checkout on this machine", what, h.confined)
}

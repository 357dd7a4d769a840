package sessions

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
)

// Init writes the remote's sandbox config template, refusing to overwrite.
func (m *Manager) Init(ctx context.Context, req ipc.InitRequest) (ipc.InitResponse, error) {
	if req.Cwd == "" || !filepath.IsAbs(req.Cwd) {
		return ipc.InitResponse{}, errdefs.Invalidf("cwd must be an absolute path, got %q", req.Cwd)
	}
	if _, err := os.Stat(req.Cwd); err != nil {
		return ipc.InitResponse{}, errdefs.Invalidf("cwd %s does not exist: %v", req.Cwd, err)
	}
	// A config belongs to a checkout: outside one, nook could only leave a
	// stray file in whatever directory the user happened to be in.
	base, err := findRepoRoot(req.Cwd)
	if err != nil {
		var nr *notRepoError
		if errors.As(err, &nr) {
			return ipc.InitResponse{}, errdefs.Invalidf("%s is not inside a git repository: nook init writes the sandbox config of a checkout; cd into your project (or run `git init` first)", req.Cwd)
		}
		return ipc.InitResponse{}, err
	}
	file := req.File
	switch {
	case file == "":
		file = filepath.Join(base, DefaultConfigRel)
	case !filepath.IsAbs(file):
		file = filepath.Join(req.Cwd, file)
	}
	file = filepath.Clean(file)
	if err := initTarget(base, file); err != nil {
		return ipc.InitResponse{}, err
	}
	if _, err := os.Lstat(file); err == nil {
		return ipc.InitResponse{}, errdefs.Conflictf("%s already exists: edit it, or remove it to get the template again", file)
	}
	remote, err := m.remote(ctx)
	if err != nil {
		return ipc.InitResponse{}, err
	}
	tmpl, err := remote.InitTemplate(ctx)
	if err != nil {
		return ipc.InitResponse{}, remoteCallFailed("get the config template from the remote", err)
	}
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
		return ipc.InitResponse{}, fmt.Errorf("create %s: %w", filepath.Dir(file), err)
	}
	f, err := os.OpenFile(file, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		if errors.Is(err, fs.ErrExist) {
			return ipc.InitResponse{}, errdefs.Conflictf("%s already exists: edit it, or remove it to get the template again", file)
		}
		return ipc.InitResponse{}, fmt.Errorf("create %s: %w", file, err)
	}
	_, werr := f.WriteString(tmpl)
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr != nil {
		os.Remove(file)
		return ipc.InitResponse{}, fmt.Errorf("write %s: %w", file, werr)
	}
	return ipc.InitResponse{File: file}, nil
}

// initTarget refuses a config path init must not write: outside the
// repository (or the cwd, outside a repository), inside .git (a hook would
// run code), or through a symbolic link leading out of the repository.
func initTarget(base, file string) error {
	if !within(base, file) {
		return errdefs.Invalidf("%s is outside %s: nook init writes the sandbox config inside the repository (default %s)", file, base, DefaultConfigRel)
	}
	rel, _ := filepath.Rel(base, file)
	for _, part := range strings.Split(filepath.ToSlash(rel), "/") {
		if part == ".git" {
			return errdefs.Invalidf("%s is inside .git: nook init writes the sandbox config in the working tree (default %s)", file, DefaultConfigRel)
		}
	}
	// The deepest existing directory must resolve inside the repository
	// too: a symlinked directory must not carry the write elsewhere.
	dir := filepath.Dir(file)
	for {
		if _, err := os.Lstat(dir); err == nil {
			break
		}
		if parent := filepath.Dir(dir); parent != dir {
			dir = parent
			continue
		}
		break
	}
	realBase, err := filepath.EvalSymlinks(base)
	if err != nil {
		return fmt.Errorf("resolve %s: %w", base, err)
	}
	realDir, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return fmt.Errorf("resolve %s: %w", dir, err)
	}
	if !within(realBase, realDir) {
		return errdefs.Invalidf("%s leads to %s, outside %s: nook init writes only inside the repository", dir, realDir, base)
	}
	return nil
}

package sandboxhelper

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/sandboxd/sandboxd/sandboxhelper/hold"
)

// gitPlaces are what an exchange's exec prelude adds to the sandbox's
// PATH for its scripts (the sandbox's own may be minimal).
const gitPlaces = ":/usr/local/bin:/usr/bin:/bin"

// relayExchange runs an exchange that the relay was asked for
// (hold.Options.Exchange) in the relay's own process, in dir with env,
// doing first what the exchange's exec request would have done before the
// helper: the request's setup shell when it has something to do, the
// scripts' PATH with git's usual places, the command's the sandbox's own.
// A setup that fails ends it with the setup's status and no answer, as the
// exec's would: the daemon takes the separate steps.
func relayExchange(ctx context.Context, req hold.RelayRequest, dir string, env []string, in io.Reader, out, log io.Writer) int {
	p0 := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			p0 = v
		}
	}
	senv := withPath(env, p0+gitPlaces)
	state := filepath.Join(dir, ".git", "sandboxd")
	if needSetup(dir, p0+gitPlaces, req.SetupDone) {
		cmd := exec.CommandContext(ctx, "/bin/sh", "-c", req.Setup)
		cmd.Dir, cmd.Env = dir, senv
		var stdout, stderr bytes.Buffer
		cmd.Stdout = &capped{buf: &stdout, max: maxScriptOutput}
		cmd.Stderr = &capped{buf: &stderr, max: maxScriptOutput}
		st := status(cmd.Run())
		_, _ = log.Write(stderr.Bytes())
		switch {
		case st.Signal != "":
			return 128 + signalNumber(st.Signal)
		case st.Code != 0:
			return st.Code
		}
		// The setup prints the sync state directory, which a checkout
		// whose .git is a file keeps elsewhere.
		if line, _, _ := bufio.NewReader(&stdout).ReadLine(); filepath.IsAbs(string(line)) {
			state = string(line)
		}
	}
	// As the exec's helper does: its messages in native.err too.
	if f, err := os.Create(filepath.Join(state, "native.err")); err == nil {
		defer f.Close()
		log = io.MultiWriter(f, log)
	}
	return Exchange(ctx, ExchangeOptions{State: state, Root: dir, Path: p0, Env: senv, InRelay: true}, in, out, log)
}

// needSetup says whether the setup shell has something to do in the
// checkout dir: its .git is not a directory holding the sync state
// directory, git is not on path, or none of done (paths under .git)
// exists.
func needSetup(dir, path string, done []string) bool {
	gd := filepath.Join(dir, ".git")
	if fi, err := os.Lstat(gd); err != nil || !fi.IsDir() {
		return true
	}
	if fi, err := os.Stat(filepath.Join(gd, "sandboxd")); err != nil || !fi.IsDir() {
		return true
	}
	git := false
	for _, d := range filepath.SplitList(path) {
		if fi, err := os.Stat(filepath.Join(d, "git")); d != "" && err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			git = true
			break
		}
	}
	if !git {
		return true
	}
	for _, p := range done {
		if !filepath.IsLocal(p) {
			continue
		}
		if _, err := os.Lstat(filepath.Join(gd, p)); err == nil {
			return false
		}
	}
	return true
}

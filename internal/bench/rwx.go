package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

// The RWX path: what RWX Cloud users get. A daemon of its own with remote
// "rwx" pointed at the bench's localcloud, which behaves as RWX Cloud (the
// runs API, the agent and its managed processes), its delay line on API
// and SSH alike; once with the sandbox helper (the default) and once with
// sync_helper off, each with its own repositories and sandboxes.

// rwxSizes: the repositories of the RWX rows and the samples per row.
type rwxSizes struct {
	files   []int
	n       int
	nSynced int
}

var (
	rwxFull  = rwxSizes{files: []int{200, 30000}, n: 21, nSynced: 21}
	rwxQuick = rwxSizes{files: []int{200, 2000}, n: 5, nSynced: 5}
)

// rwxVariant is one RWX-path daemon.
type rwxVariant struct {
	name  string // in the rows' names
	r     *runner
	repos map[int]string // files → repository
}

// rwxPath runs the RWX rows at each of Options.RWXRTTs.
func (r *runner) rwxPath(ctx context.Context) error {
	sz := rwxFull
	if r.opts.Quick {
		sz = rwxQuick
	}
	var variants []*rwxVariant
	for _, v := range []struct {
		name   string
		config map[string]any
	}{
		{"rwx", nil},
		{"rwx, sync_helper off", map[string]any{"sync_helper": "off"}},
	} {
		rv, err := r.rwxDaemon(ctx, v.name, v.config, sz)
		if err != nil {
			return err
		}
		defer rv.r.e.close()
		variants = append(variants, rv)
	}
	for _, rtt := range r.opts.RWXRTTs {
		r.rtt = rtt
		if err := r.e.setDelay(ctx, rtt/2); err != nil {
			return err
		}
		r.logf("RWX-path scenarios at %s RTT", rtt)
		for _, v := range variants {
			v.r.rtt = rtt
			if err := v.rows(ctx, sz); err != nil {
				return fmt.Errorf("%s at %s RTT: %w", v.name, rtt, err)
			}
		}
	}
	r.rtt = 0
	return r.e.setDelay(ctx, 0)
}

// rwxDaemon starts an RWX-path daemon (config: its config file) in an
// environment of its own, makes its repositories, starts their sandboxes
// and waits for their helpers.
func (r *runner) rwxDaemon(ctx context.Context, name string, config map[string]any, sz rwxSizes) (*rwxVariant, error) {
	dir := filepath.Join(r.root, "rwx"+strconv.Itoa(len(r.res.Rows))+"-"+strconv.FormatInt(time.Now().UnixNano(), 36))
	e, err := newEnv(r.opts.Bin, filepath.Join(dir, "user"))
	if err != nil {
		return nil, err
	}
	// The localcloud is the bench's: its API for the counters.
	e.lcHTTP, e.lcToken, e.lcAPI, e.lcCert = r.e.lcHTTP, r.e.lcToken, r.e.lcAPI, r.e.lcCert
	if config != nil {
		b, _ := json.Marshal(config)
		cfg := filepath.Join(e.get("XDG_CONFIG_HOME"), "sandboxd", "config.json")
		if err := os.MkdirAll(filepath.Dir(cfg), 0o700); err != nil {
			return nil, err
		}
		if err := os.WriteFile(cfg, b, 0o600); err != nil {
			return nil, err
		}
	}
	if err := e.startDaemon(ctx, "SANDBOXD_REMOTE=rwx", "RWX_HOST="+e.lcAPI, "RWX_ACCESS_TOKEN="+e.lcToken, "SSL_CERT_FILE="+e.lcCert); err != nil {
		e.close()
		return nil, fmt.Errorf("the %s daemon: %w", name, err)
	}
	sub := &runner{opts: r.opts, sz: r.sz, e: e, res: r.res, root: dir, sized: map[int]string{}, runOf: map[string]string{}}
	rv := &rwxVariant{name: name, r: sub, repos: map[int]string{}}
	r.logf("%s: making repositories %v", name, sz.files)
	for _, n := range sz.files {
		repo := filepath.Join(dir, "src", fmt.Sprintf("files%d", n))
		if err := e.makeRepo(repo, n); err != nil {
			e.close()
			return nil, err
		}
		rv.repos[n] = repo
		if err := sub.startSandbox(ctx, repo); err != nil {
			e.close()
			return nil, err
		}
	}
	// Connected, and with the helper (the default) serving: its start
	// falls on no measured call.
	for _, repo := range rv.repos {
		if _, err := sub.libExec(ctx, repo, false, "true"); err != nil {
			e.close()
			return nil, fmt.Errorf("connect to the sandbox of %s: %w", repo, err)
		}
		if config != nil {
			continue
		}
		served, err := r.waitFor(ctx, func() (bool, error) { return e.helperServes(ctx, sub.runOf[repo]), nil })
		if err != nil {
			e.close()
			return nil, err
		}
		if !served {
			r.note("RWX path: the sandbox helper of %s did not start within %s: its rows measure the plain sync", repo, waitLimit)
		}
	}
	return rv, nil
}

// rows measures one variant at the current RTT: no-sync exec, then a
// synced exec of one changed file in each size.
func (v *rwxVariant) rows(ctx context.Context, sz rwxSizes) error {
	r := v.r
	small := v.repos[sz.files[0]]
	row, err := r.measure(ctx, v.name+": exec --no-sync -- true, nook", sz.n, 2, 1, []string{r.runOf[small]}, func(int) error {
		return r.e.nook(ctx, small, "exec", "--no-sync", "--", "true")
	})
	if err != nil {
		return err
	}
	r.add(row)
	for _, files := range sz.files {
		repo := v.repos[files]
		change := func(tag string, i int) error {
			return os.WriteFile(filepath.Join(repo, "README.md"), []byte("change "+tag+" "+strconv.Itoa(i)+"\n"), 0o644)
		}
		row, err := r.measureChanged(ctx, fmt.Sprintf("%s: synced exec -- true, 1 changed file, %d files, nook", v.name, files), sz.nSynced, []string{r.runOf[repo]}, change, "nook", func() error {
			return r.e.nook(ctx, repo, "exec", "--", "true")
		})
		if err != nil {
			return err
		}
		r.add(row)
	}
	return nil
}

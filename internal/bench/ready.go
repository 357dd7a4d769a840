package bench

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
	"github.com/sandboxd/sandboxd/store"
)

func execReq(repo string) ipc.ExecRequest {
	return ipc.ExecRequest{Target: ipc.Target{Cwd: repo}, Argv: stampArgv, NoSync: true}
}

func execOpts(out *bytes.Buffer) client.ExecOptions {
	return client.ExecOptions{Stdout: out}
}

// ready times a daemon's start to READY=1 with many sessions in its store
// (restored before each start, since the background re-checks change it).
func (r *runner) ready(ctx context.Context) error {
	e, err := newEnv(r.opts.Bin, filepath.Join(r.root, "ready"))
	if err != nil {
		return err
	}
	defer e.close()
	db := filepath.Join(e.get("XDG_STATE_HOME"), "sandboxd", "sandboxd.db")
	if err := os.MkdirAll(filepath.Dir(db), 0o700); err != nil {
		return err
	}
	st, err := store.Open(ctx, db, store.Options{})
	if err != nil {
		return err
	}
	for i := range r.sz.readySess {
		s := &store.Session{
			Identity:       store.Identity{RepoRoot: fmt.Sprintf("/src/repo%d", i), Branch: "main", ConfigFile: fmt.Sprintf("/src/repo%d/.rwx/sandbox.yml", i)},
			Remote:         "local",
			RunID:          fmt.Sprintf("run-%04d", i),
			IdempotencyKey: fmt.Sprintf("key-%04d", i),
			Address:        "127.0.0.1:1",
			State:          store.StateReady,
		}
		if err := st.Insert(s); err != nil {
			st.Close()
			return err
		}
	}
	if err := st.Close(); err != nil {
		return err
	}
	golden, err := os.ReadFile(db)
	if err != nil {
		return err
	}
	sock := filepath.Join(e.root, "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		return err
	}
	defer conn.Close()
	var samples []time.Duration
	for range r.sz.nReady {
		if err := os.WriteFile(db, golden, 0o600); err != nil {
			return err
		}
		cmd := exec.Command(filepath.Join(r.opts.Bin, "sandboxd"))
		// The background re-checks after READY go to a remote that refuses
		// at once: a local remote would be started (detached) by a daemon
		// this benchmark stops right away.
		cmd.Env = append(slices.Clone(e.vars), "NOTIFY_SOCKET="+sock, "SANDBOXD_REMOTE=rwx", "RWX_HOST=http://127.0.0.1:1", "RWX_ACCESS_TOKEN=bench")
		var logs bytes.Buffer
		cmd.Stdout, cmd.Stderr = &logs, &logs
		start := time.Now()
		if err := cmd.Start(); err != nil {
			return err
		}
		werr := waitNotify(conn, "READY=1", 30*time.Second)
		took := time.Since(start)
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if werr != nil {
			return fmt.Errorf("READY with %d sessions: %w\n%s", r.sz.readySess, werr, logs.Bytes())
		}
		samples = append(samples, took)
	}
	med, p95 := stats(samples)
	r.add(Row{Scenario: fmt.Sprintf("daemon start to READY=1, %d sessions", r.sz.readySess), N: len(samples), MedianMs: med, P95Ms: p95, ExecsPerCall: -1, ChansPerCall: -1, APIPerCall: -1})
	return nil
}

// waitNotify reads datagrams until one has the line want.
func waitNotify(conn *net.UnixConn, want string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	buf := make([]byte, 4096)
	for {
		_ = conn.SetReadDeadline(deadline)
		n, err := conn.Read(buf)
		if err != nil {
			return fmt.Errorf("no %s: %w", want, err)
		}
		for _, line := range strings.Split(string(buf[:n]), "\n") {
			if line == want {
				return nil
			}
		}
	}
}

// ratios compares rows of the same run.
func (r *runner) ratios() {
	find := func(name string, rtt int) (Row, bool) {
		for _, row := range r.res.Rows {
			if row.Scenario == name && row.RTTms == rtt {
				return row, true
			}
		}
		return Row{}, false
	}
	add := func(name, num, den string, rtt int, note string) {
		a, ok1 := find(num, rtt)
		b, ok2 := find(den, rtt)
		if ok1 && ok2 && b.MedianMs > 0 {
			r.res.Ratios = append(r.res.Ratios, Ratio{Name: name, RTTms: rtt, Value: a.MedianMs / b.MedianMs, Note: note})
		}
	}
	// addExtra is the ratio of an extra figure of two rows.
	addExtra := func(name, num, den, key string, rtt int) {
		a, ok1 := find(num, rtt)
		b, ok2 := find(den, rtt)
		if ok1 && ok2 && b.Extra[key] > 0 {
			r.res.Ratios = append(r.res.Ratios, Ratio{Name: name, RTTms: rtt, Value: a.Extra[key] / b.Extra[key]})
		}
	}
	small := r.sz.repoFiles[0]
	big := r.sz.repoFiles[len(r.sz.repoFiles)-1]
	synced := func(files int, how string) string {
		return fmt.Sprintf("synced exec -- true, 1 changed file, %d files, %s", files, how)
	}
	for _, rtt := range r.opts.RTTs {
		ms := int(rtt.Milliseconds())
		add("nook no-sync / OpenSSH ControlMaster (medians)", "exec --no-sync -- true, nook, paired with baseline B", "baseline B: OpenSSH ControlMaster `ssh true`", ms, "target <= 0.6 at 0 ms")
		add("nook no-sync / client library (the shim's cost)", "exec --no-sync -- true, nook", "exec --no-sync -- true, client library", ms, "")
		add("nook no-sync / agent floor", "exec --no-sync -- true, nook", "agent direct: kept SSH connection, new channel + true", ms, "")
		add("baseline A / nook no-sync", "baseline A: API call + fresh SSH + lock + true + unlock", "exec --no-sync -- true, nook", ms, "")
		add(fmt.Sprintf("synced %d files / %d files, nook", big, small), synced(big, "nook"), synced(small, "nook"), ms, "target <= 1.5")
		add("synced / no-sync, nook", synced(small, "nook"), "exec --no-sync -- true, nook", ms, "")
		same := func(files int) string {
			return fmt.Sprintf("synced exec -- true, nothing changed since the last exec, %d files, nook", files)
		}
		add(fmt.Sprintf("synced, nothing changed, %d files / %d files, nook", big, small), same(big), same(small), ms, "")
		for _, files := range r.sz.repoFiles {
			add(fmt.Sprintf("nook start --wait / RWX CLI start --wait, %d files", files), startRow(files, "nook"), startRow(files, "RWX CLI"), ms, "target <= 1")
			addExtra(fmt.Sprintf("nook start --wait / RWX CLI start --wait, %d files, own share (but provisioning)", files), startRow(files, "nook"), startRow(files, "RWX CLI"), "own_ms", ms)
		}
		add("RWX CLI synced / nook synced", "baseline A: RWX CLI `rwx sandbox exec -- true`, 1 changed file", synced(small, "nook"), ms, "")
	}
}

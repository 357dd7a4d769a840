// Command sandboxd-localcloud is the local remote of sandboxd: a runs API
// compatible with RWX Cloud plus one SSH sandbox agent per run, with
// sandboxes as git checkouts on this machine.
//
//	sandboxd-localcloud serve [flags]   run the server in the foreground
//	sandboxd-localcloud status [--json] show the running server
//	sandboxd-localcloud stop [--json]   stop it (agents stopped, runs kept)
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/sandboxd/sandboxd/daemon/paths"
	"github.com/sandboxd/sandboxd/localcloud"
	"github.com/sandboxd/sandboxd/localcloud/agent"
	"github.com/sandboxd/sandboxd/localcloud/sandbox"
)

// Version is set at build time (-X main.Version=...).
var Version = "dev"

const usage = `usage: sandboxd-localcloud <command> [flags]

commands:
  serve     run the server in the foreground
  status    show the running server (--json for the discovery record)
  stop      stop the running server: agents stop, runs are kept
  version   print the version

Run "sandboxd-localcloud <command> -h" for the flags of a command.
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	switch args[0] {
	case "serve":
		return serve(args[1:], stdout, stderr)
	case "status":
		return status(args[1:], stdout, stderr)
	case "stop":
		return stop(args[1:], stdout, stderr)
	case "version", "--version":
		fs := flag.NewFlagSet("version", flag.ContinueOnError)
		asJSON := fs.Bool("json", false, "print JSON")
		if err := fs.Parse(args[1:]); err != nil {
			return 2
		}
		if *asJSON {
			return printJSON(stdout, map[string]string{"version": Version})
		}
		fmt.Fprintln(stdout, "sandboxd-localcloud", Version)
		return 0
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "sandboxd-localcloud: unknown command %q\n%s", args[0], usage)
		return 2
	}
}

func defaultDir() string {
	l, err := paths.Resolve(paths.OSEnv)
	if err != nil {
		return ""
	}
	return l.LocalcloudDir()
}

func serve(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("state-dir", defaultDir(), "state directory")
	listen := fs.String("listen", localcloud.DefaultListen, "HTTPS address of the runs API")
	httpAddr := fs.String("http", "", "also serve plain HTTP on this address (off when empty)")
	idle := fs.Duration("idle-timeout", localcloud.DefaultIdleTimeout, "end a sandbox after this long without activity")
	lifetime := fs.Duration("max-lifetime", localcloud.DefaultMaxLifetime, "end any run after this long")
	sweep := fs.Duration("sweep-interval", 0, "how often deadlines are checked (derived from the timeouts when 0)")
	latency := fs.Duration("fault-latency", 0, "fault injection: added latency per API request")
	delayDefault, err := envDuration(OneWayDelayEnv)
	if err != nil {
		fmt.Fprintf(stderr, "sandboxd-localcloud serve: %v\n", err)
		return 2
	}
	delay := fs.Duration("one-way-delay", delayDefault, "delay every byte of API and SSH traffic by this much each way (a round trip grows by twice it); default from $"+OneWayDelayEnv)
	rate := fs.Float64("fault-5xx-rate", 0, "fault injection: share of API requests answered 503 (0..1)")
	dropSSH := fs.Bool("fault-drop-ssh", false, "fault injection: refuse SSH connections to agents")
	enableFaults := fs.Bool("enable-fault-injection", false, "register the fault-injection routes (/admin/faults, drop-connections) and allow the --fault-* flags; for tests only")
	allowRemote := fs.Bool("allow-remote", false, "allow --listen/--http on an address other machines can reach (the runs API and its sandboxes are then exposed to the network)")
	isolation := fs.String("isolation", envOr(IsolationEnv, sandbox.IsolationNamespaces), "isolation of sandbox commands: namespaces (private mounts, processes, hostname, network; refuses to start where the machine cannot) or none (plain processes of your user); default from $"+IsolationEnv)
	network := fs.String("network", os.Getenv(NetworkEnv), "network of each sandbox: internet (the default: the internet through pasta, from the passt package, but not this machine's loopback, its addresses or private ranges; loopback only when pasta is not installed), loopback (its own, loopback only) or host (this machine's); default from $"+NetworkEnv)
	memLimit := fs.Int64("memory-limit", sandbox.DefaultMemoryBytes, "memory limit of each run in bytes (a run over it is ended)")
	maxProcs := fs.Int("max-procs", sandbox.DefaultMaxProcs, "process limit of each run")
	diskLimit := fs.Int64("disk-limit", sandbox.DefaultDiskBytes, "what each run's files (workspace, home, background logs) may take on disk, in bytes (a run over it is ended)")
	fileLimit := fs.Int64("max-file-size", sandbox.DefaultFileBytes, "largest file a sandbox command may write, in bytes (RLIMIT_FSIZE)")
	inotifyInstances := fs.Int("max-inotify-instances", 0, fmt.Sprintf("inotify instances of each run (its own user namespace's limit); 0: %d, at most a quarter of the host's", sandbox.DefaultInotifyInstances))
	inotifyWatches := fs.Int("max-inotify-watches", 0, fmt.Sprintf("inotify watches of each run; 0: %d, at most a quarter of the host's", sandbox.DefaultInotifyWatches))
	share := fs.String("share", os.Getenv(ShareEnv), "comma-separated directories every sandbox also sees, writable, at the same paths (none by default; tests share their scratch directory); default from $"+ShareEnv)
	toolchains := fs.String("toolchain", os.Getenv(ToolchainEnv), "comma-separated directories every sandbox sees read-only at the same paths, their bin directory first on PATH (toolchains under your home: ~/.cargo, a Node version of nvm); default from $"+ToolchainEnv)
	keepalive := fs.Duration("agent-keepalive-interval", agent.DefaultKeepaliveInterval, "how often each sandbox agent asks its SSH clients for a sign of life (negative: never)")
	keepaliveCount := fs.Int("agent-keepalive-count", agent.DefaultKeepaliveCount, "a client that answers no keepalive for this many intervals is disconnected and its sandbox lock released")
	verbose := fs.Bool("verbose", false, "debug logging")
	asJSON := fs.Bool("json", false, "log as JSON lines")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "sandboxd-localcloud serve: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	var handler slog.Handler = slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level})
	if *asJSON {
		handler = slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level})
	}
	log := slog.New(handler)
	srv, err := localcloud.New(localcloud.Config{
		Dir: *dir, Listen: *listen, HTTPListen: *httpAddr,
		IdleTimeout: *idle, MaxLifetime: *lifetime, SweepInterval: *sweep,
		Faults:      localcloud.Faults{LatencyMS: latency.Milliseconds(), ErrorRate5xx: *rate, DropSSH: *dropSSH},
		Logger:      log,
		Version:     Version,
		OneWayDelay: *delay,
		Sandbox: sandbox.Options{Isolation: *isolation, Network: *network, MemoryBytes: *memLimit, MaxProcs: *maxProcs,
			DiskBytes: *diskLimit, FileBytes: *fileLimit, InotifyInstances: *inotifyInstances, InotifyWatches: *inotifyWatches,
			Share: splitList(*share), Toolchains: splitList(*toolchains)},

		AgentKeepaliveInterval: *keepalive,
		AgentKeepaliveCount:    *keepaliveCount,

		EnableFaultInjection: *enableFaults,
		AllowRemote:          *allowRemote,
	})
	if err != nil {
		fmt.Fprintln(stderr, prefixed("sandboxd-localcloud", err))
		return 1
	}
	ctx, stopSignals := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stopSignals()
	if err := srv.Start(ctx); err != nil {
		fmt.Fprintln(stderr, prefixed("sandboxd-localcloud", err))
		if errors.Is(err, localcloud.ErrAlreadyRunning) {
			return localcloud.ExitAlreadyRunning
		}
		return 1
	}
	fmt.Fprintf(stdout, "sandboxd-localcloud serving %s (state %s)\n", srv.APIURL(), srv.Dir())
	<-ctx.Done()
	log.Info("stopping: agents stop, runs are kept")
	shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Close(shutdown); err != nil {
		fmt.Fprintf(stderr, "sandboxd-localcloud: stop: %v\n", err)
		return 1
	}
	return 0
}

func status(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("state-dir", defaultDir(), "state directory")
	asJSON := fs.Bool("json", false, "print the discovery record as JSON")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	d, err := localcloud.Status(context.Background(), *dir)
	if err != nil {
		if *asJSON {
			printJSON(stdout, map[string]any{"running": false, "error": err.Error(), "state_dir": *dir})
		} else {
			fmt.Fprintln(stderr, prefixed("sandboxd-localcloud", err))
		}
		return 1
	}
	if *asJSON {
		return printJSON(stdout, struct {
			localcloud.Discovery
			Running bool `json:"running"`
		}{d, true})
	}
	fmt.Fprintf(stdout, "running: pid %d, version %s, since %s\napi:   %s\n", d.PID, d.Version, d.StartedAt.Format(time.RFC3339), d.APIURL)
	if d.HTTPURL != "" {
		fmt.Fprintf(stdout, "http:  %s\n", d.HTTPURL)
	}
	fmt.Fprintf(stdout, "cert:  %s\ntoken: %s\nstate: %s\n", d.CertFile, d.TokenFile, d.StateDir)
	if d.Isolation != nil {
		fmt.Fprintf(stdout, "isolation: %s\n", d.Isolation.Summary())
	}
	return 0
}

func stop(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("stop", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("state-dir", defaultDir(), "state directory")
	timeout := fs.Duration("timeout", 15*time.Second, "how long to wait for the server to exit")
	asJSON := fs.Bool("json", false, "print the result as JSON")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	d, err := localcloud.Stop(context.Background(), *dir, *timeout)
	if errors.Is(err, localcloud.ErrNotRunning) {
		// Stopping what is not running is not a failure.
		if *asJSON {
			return printJSON(stdout, map[string]any{"stopped": false, "running": false})
		}
		fmt.Fprintln(stdout, "sandboxd-localcloud is not running")
		return 0
	}
	if err != nil {
		if *asJSON {
			printJSON(stdout, map[string]any{"stopped": false, "error": err.Error()})
		} else {
			fmt.Fprintln(stderr, prefixed("sandboxd-localcloud", err))
		}
		return 1
	}
	if *asJSON {
		return printJSON(stdout, map[string]any{"stopped": true, "pid": d.PID})
	}
	fmt.Fprintf(stdout, "stopped sandboxd-localcloud (pid %d)\n", d.PID)
	return 0
}

// OneWayDelayEnv sets the default of serve --one-way-delay, so that a
// localcloud started by sandboxd (which passes its environment on) can be
// made to behave like a distant remote.
const OneWayDelayEnv = "SANDBOXD_LOCALCLOUD_ONE_WAY_DELAY"

// IsolationEnv and NetworkEnv set the defaults of serve --isolation and
// --network (sandboxd passes its environment on to the localcloud it
// starts).
const (
	IsolationEnv = "SANDBOXD_LOCALCLOUD_ISOLATION"
	NetworkEnv   = "SANDBOXD_LOCALCLOUD_NETWORK"
	ShareEnv     = "SANDBOXD_LOCALCLOUD_SHARE"
	ToolchainEnv = "SANDBOXD_LOCALCLOUD_TOOLCHAINS"
)

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func envDuration(name string) (time.Duration, error) {
	v := os.Getenv(name)
	if v == "" {
		return 0, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return 0, fmt.Errorf("$%s=%q is not a duration: use a value such as 10ms", name, v)
	}
	return d, nil
}

func printJSON(w io.Writer, v any) int {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return 1
	}
	return 0
}

// prefixed is "prog: err", naming the program once: an error that starts
// with the program's name already says who speaks.
func prefixed(prog string, err error) string {
	msg := err.Error()
	if strings.HasPrefix(msg, prog+" ") || strings.HasPrefix(msg, prog+":") {
		return msg
	}
	return prog + ": " + msg
}

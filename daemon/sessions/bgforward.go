package sessions

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"gopkg.in/yaml.v3"

	"github.com/sandboxd/sandboxd/daemon/events"
	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/store"
)

// BgForward forwards a local port to a port of a running background
// process (its own target port by default) without restarting it, as `rwx
// sandbox tunnel --key K --port P` does: the process may have been started
// by nook, by the RWX CLI or predefined in the config. The forward is the
// daemon's, recorded with the process like one bg start opened.
func (m *Manager) BgForward(ctx context.Context, req ipc.BgForwardRequest) (ipc.BgProcess, error) {
	if m.opts.Forwards == nil {
		return ipc.BgProcess{}, errdefs.Unavailable(errors.New("port forwarding is not available in this daemon"))
	}
	s, _, err := m.bgSession(ctx, req.Target)
	if err != nil {
		return ipc.BgProcess{}, err
	}
	conn, err := m.connect(ctx, s)
	if err != nil {
		return ipc.BgProcess{}, err
	}
	rec, err := m.processDirective(ctx, conn, directiveProcessStatus, map[string]any{"key": req.Name})
	if err != nil {
		return ipc.BgProcess{}, err
	}
	rec.Key = req.Name
	if rec.Status != "running" {
		return m.bgProcess(s, rec), errdefs.Conflictf("background process %q is not running (%s): start it first (`nook bg start --key %s`)", req.Name, describeEnd(rec), req.Name)
	}
	port := req.Port
	if port == 0 {
		port = rec.TargetPort
	}
	if port == 0 {
		return ipc.BgProcess{}, errdefs.Invalidf("background process %q has no port of its own: say which sandbox port to forward (--port)", req.Name)
	}
	prev := findBackground(s, req.Name)
	if _, err := m.openForward(s, req.Name, port, req.LocalPort, prev); err != nil {
		return ipc.BgProcess{}, err
	}
	bg := store.Background{Name: req.Name, Command: rec.Command, TargetPort: port, Forwarding: true}
	if prev != nil {
		bg.Started = prev.Started
		if bg.Command == "" {
			bg.Command = prev.Command
		}
	}
	if info, ok := m.forwardOf(s, req.Name); ok {
		bg.LocalPort = info.LocalPort
	}
	s = m.saveBackground(s, bg)
	m.publish(events.ForwardOpened, s, map[string]any{"name": req.Name, "targetPort": port, "process": "running"})
	rec.TargetPort = port
	return m.waitPort(ctx, s, rec, m.bgProcess(s, rec))
}

// predefinedProcess is a background process the sandbox config defines
// under a key, started with `nook bg start --key KEY`. localcloud ignores
// the field; RWX reads its own.
type predefinedProcess struct {
	Key  string `yaml:"key"`
	Run  string `yaml:"run"`
	Port int    `yaml:"port"`
}

// maxConfigRead bounds reading the user's sandbox config.
const maxConfigRead = 1 << 20

// lookupPredefined finds the process predefined under key in the sandbox
// config file: `background-processes:` of a task (the sandbox task), each
// with key, run and an optional port.
func lookupPredefined(configFile, key string) (predefinedProcess, error) {
	f, err := os.Open(configFile)
	if err != nil {
		return predefinedProcess{}, errdefs.Invalidf("no command given and the sandbox config %s cannot be read for a predefined process %q: %v", configFile, key, err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxConfigRead+1))
	n := len(b)
	var cfg struct {
		Tasks []struct {
			Background []predefinedProcess `yaml:"background-processes"`
		} `yaml:"tasks"`
	}
	if err != nil || n > maxConfigRead || yaml.Unmarshal(b, &cfg) != nil {
		return predefinedProcess{}, errdefs.Invalidf("no command given and the sandbox config %s is not readable YAML: give the command after --", configFile)
	}
	var known []string
	for _, t := range cfg.Tasks {
		for _, p := range t.Background {
			if p.Key == key && strings.TrimSpace(p.Run) != "" {
				if p.Port < 0 || p.Port > 65535 {
					return predefinedProcess{}, errdefs.Invalidf("predefined process %q in %s: port %d is not a port", key, configFile, p.Port)
				}
				return p, nil
			}
			known = append(known, p.Key)
		}
	}
	if len(known) == 0 {
		return predefinedProcess{}, errdefs.Invalidf("no command given, and %s predefines no background process: give the command after --, or add `background-processes: [{key: %s, run: CMD, port: PORT}]` to its sandbox task", configFile, key)
	}
	return predefinedProcess{}, errdefs.Invalidf("no command given, and %s predefines no background process %q (it has: %s): give the command after --", configFile, key, strings.Join(known, ", "))
}

// predefinedCommand is the command and port of a bg start without argv.
func predefinedCommand(s *store.Session, req ipc.BgStartRequest) (command string, port int, err error) {
	if s.ConfigFile == "" || strings.HasPrefix(s.ConfigFile, "run:") {
		return "", 0, errdefs.Invalidf("no command given and sandbox %s has no config file here to predefine %q: give the command after --", s.RunID, req.Name)
	}
	p, err := lookupPredefined(s.ConfigFile, req.Name)
	if err != nil {
		return "", 0, fmt.Errorf("start background process %q: %w", req.Name, err)
	}
	port = req.Port
	if port == 0 {
		port = p.Port
	}
	return p.Run, port, nil
}

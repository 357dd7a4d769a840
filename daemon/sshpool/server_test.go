package sshpool

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"
)

// testServer is a minimal sandbox agent: exec runs /bin/sh -c in its own
// process group, signals reach that group, exit-status / exit-signal are
// reported, keepalives answered. Switches let tests silence keepalives,
// refuse handshakes and drop connections.
type testServer struct {
	ln         net.Listener
	cfg        *ssh.ServerConfig
	hostPub    string // authorized_keys line
	userKeyPEM string

	muteKeepalive atomic.Bool // stop answering keepalives
	muteOpens     atomic.Bool // leave channel opens unanswered
	refuse        atomic.Bool // close new connections before the handshake
	accepted      atomic.Int64
	opens         atomic.Int64 // session channels opened

	mu    sync.Mutex
	conns map[net.Conn]struct{}
	runs  map[string]int
	execs []execRecord
	procs map[*exec.Cmd]struct{}

	wg sync.WaitGroup
}

// execRecord is one exec request: the command and the ordinal of the
// session channel it came on (1 = first channel opened on the server).
type execRecord struct {
	command string
	channel int64
	opened  int64 // session channels opened on the server when it came
}

// dropCommand makes the server count the exec and then cut the TCP
// connection without answering: the request reached the agent, the answer
// never comes back.
const dropCommand = "__test_drop_after_exec__"

// silentCommand makes the server count the exec and never answer it,
// the connection otherwise fine.
const silentCommand = "__test_never_answer_exec__"

// forgedExit reads the commands "__test_exit_status__ N" and
// "__test_exit_signal__ NAME": the server answers that exit report as is.
func forgedExit(command string) (status uint32, signal string, ok bool) {
	if rest, ok := strings.CutPrefix(command, "__test_exit_status__ "); ok {
		n, err := strconv.ParseUint(rest, 10, 32)
		return uint32(n), "", err == nil
	}
	if rest, ok := strings.CutPrefix(command, "__test_exit_signal__ "); ok {
		return 0, rest, true
	}
	return 0, "", false
}

func newTestServer(t testing.TB) *testServer {
	t.Helper()
	_, hostPriv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	hostSigner, err := ssh.NewSignerFromKey(hostPriv)
	if err != nil {
		t.Fatal(err)
	}
	userPub, userPriv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	block, err := ssh.MarshalPrivateKey(userPriv, "")
	if err != nil {
		t.Fatal(err)
	}
	sshUserPub, err := ssh.NewPublicKey(userPub)
	if err != nil {
		t.Fatal(err)
	}
	s := &testServer{
		hostPub:    string(ssh.MarshalAuthorizedKey(hostSigner.PublicKey())),
		userKeyPEM: string(pem.EncodeToMemory(block)),
		conns:      map[net.Conn]struct{}{},
		runs:       map[string]int{},
		procs:      map[*exec.Cmd]struct{}{},
	}
	s.cfg = &ssh.ServerConfig{
		PublicKeyCallback: func(md ssh.ConnMetadata, key ssh.PublicKey) (*ssh.Permissions, error) {
			if md.User() == "rwx-cli" && string(key.Marshal()) == string(sshUserPub.Marshal()) {
				return nil, nil
			}
			return nil, fmt.Errorf("unknown key for %s", md.User())
		},
	}
	s.cfg.AddHostKey(hostSigner)
	s.ln, err = net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s.wg.Add(1)
	go s.accept()
	t.Cleanup(s.stop)
	return s
}

func (s *testServer) target(runID string) Target {
	return Target{RunID: runID, Address: s.ln.Addr().String(), PublicHostKey: s.hostPub, PrivateUserKey: s.userKeyPEM}
}

func (s *testServer) stop() {
	s.ln.Close()
	s.mu.Lock()
	for p := range s.procs {
		_ = syscall.Kill(-p.Process.Pid, syscall.SIGKILL)
	}
	s.mu.Unlock()
	s.dropAll()
	s.wg.Wait()
}

// dropAll cuts every connection at the TCP level.
func (s *testServer) dropAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for c := range s.conns {
		c.Close()
	}
}

func (s *testServer) runCount(command string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.runs[command]
}

func (s *testServer) execLog() []execRecord {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]execRecord(nil), s.execs...)
}

func (s *testServer) accept() {
	defer s.wg.Done()
	for {
		nc, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.accepted.Add(1)
		if s.refuse.Load() {
			nc.Close()
			continue
		}
		s.mu.Lock()
		s.conns[nc] = struct{}{}
		s.mu.Unlock()
		s.wg.Add(1)
		go s.serveConn(nc)
	}
}

func (s *testServer) serveConn(nc net.Conn) {
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.conns, nc)
		s.mu.Unlock()
		nc.Close()
	}()
	_, chans, reqs, err := ssh.NewServerConn(nc, s.cfg)
	if err != nil {
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for r := range reqs {
			if r.Type == "keepalive@openssh.com" && s.muteKeepalive.Load() {
				continue // never answer: the client must notice
			}
			if r.WantReply {
				_ = r.Reply(r.Type == "keepalive@openssh.com", nil)
			}
		}
	}()
	var unanswered []ssh.NewChannel
	defer func() {
		for _, nch := range unanswered {
			_ = nch.Reject(ssh.ResourceShortage, "the test ends")
		}
	}()
	for nch := range chans {
		if s.muteOpens.Load() {
			unanswered = append(unanswered, nch)
			continue
		}
		if nch.ChannelType() != "session" {
			_ = nch.Reject(ssh.UnknownChannelType, "only sessions")
			continue
		}
		ch, creqs, err := nch.Accept()
		if err != nil {
			continue
		}
		ordinal := s.opens.Add(1)
		s.wg.Add(1)
		go s.serveSession(nc, ch, creqs, ordinal)
	}
}

func (s *testServer) serveSession(nc net.Conn, ch ssh.Channel, reqs <-chan *ssh.Request, ordinal int64) {
	defer s.wg.Done()
	defer ch.Close()
	var cmd *exec.Cmd
	exited := make(chan struct{})
	for r := range reqs {
		switch r.Type {
		case "exec":
			var m struct{ Command string }
			if ssh.Unmarshal(r.Payload, &m) != nil || cmd != nil {
				_ = r.Reply(false, nil)
				continue
			}
			s.mu.Lock()
			s.runs[m.Command]++
			s.execs = append(s.execs, execRecord{m.Command, ordinal, s.opens.Load()})
			s.mu.Unlock()
			switch m.Command {
			case dropCommand:
				nc.Close()
				continue
			case silentCommand:
				continue
			}
			if st, sig, ok := forgedExit(m.Command); ok {
				_ = r.Reply(true, nil)
				if sig != "" {
					_, _ = ch.SendRequest("exit-signal", false, ssh.Marshal(struct {
						Signal     string
						CoreDumped bool
						Error      string
						Lang       string
					}{sig, false, strings.Repeat("x", 1<<16), ""}))
				} else {
					_, _ = ch.SendRequest("exit-status", false, ssh.Marshal(struct{ Status uint32 }{st}))
				}
				ch.Close()
				return
			}
			cmd = exec.Command("/bin/sh", "-c", m.Command)
			cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
			cmd.Stdout, cmd.Stderr = ch, ch.Stderr()
			cmd.WaitDelay = 2 * time.Second
			stdin, _ := cmd.StdinPipe()
			if err := cmd.Start(); err != nil {
				cmd = nil
				_ = r.Reply(false, nil)
				continue
			}
			_ = r.Reply(true, nil)
			s.mu.Lock()
			s.procs[cmd] = struct{}{}
			s.mu.Unlock()
			go func() { _, _ = io.Copy(stdin, ch); stdin.Close() }()
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				defer close(exited)
				err := cmd.Wait()
				s.mu.Lock()
				delete(s.procs, cmd)
				s.mu.Unlock()
				sendExit(ch, cmd, err)
				ch.Close()
			}()
		case "signal":
			var m struct{ Signal string }
			if ssh.Unmarshal(r.Payload, &m) == nil && cmd != nil {
				if sig, ok := signalsByName[m.Signal]; ok {
					_ = syscall.Kill(-cmd.Process.Pid, sig)
				}
			}
		default:
			if r.WantReply {
				_ = r.Reply(false, nil)
			}
		}
	}
	if cmd != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // client gone: no orphans
		<-exited
	}
}

var signalsByName = map[string]syscall.Signal{
	"INT": syscall.SIGINT, "TERM": syscall.SIGTERM, "KILL": syscall.SIGKILL,
	"HUP": syscall.SIGHUP, "USR1": syscall.SIGUSR1,
}

func sendExit(ch ssh.Channel, cmd *exec.Cmd, err error) {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			name := strings.TrimPrefix(strings.ToUpper(unix2name(ws.Signal())), "SIG")
			_, _ = ch.SendRequest("exit-signal", false, ssh.Marshal(struct {
				Signal     string
				CoreDumped bool
				Error      string
				Lang       string
			}{name, false, "", ""}))
			return
		}
	}
	_, _ = ch.SendRequest("exit-status", false, ssh.Marshal(struct{ Status uint32 }{uint32(cmd.ProcessState.ExitCode())}))
}

func unix2name(sig syscall.Signal) string {
	for name, s := range signalsByName {
		if s == sig {
			return name
		}
	}
	return fmt.Sprintf("SIG%d", int(sig))
}

package client_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/errdefs"
	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
	"github.com/sandboxd/sandboxd/ipc/server"
)

// fakeDaemon serves sock with answer: it reads each request's head, then
// lets answer write whatever it likes and closes the connection when
// answer returns.
func fakeDaemon(t *testing.T, answer func(c net.Conn, req *http.Request)) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "nook")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "s.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { ln.Close(); <-done })
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				req, err := http.ReadRequest(bufio.NewReader(c))
				if err != nil {
					return
				}
				answer(c, req)
			}()
		}
	}()
	return sock
}

// A peer that answers something other than sandboxd's HTTP/1.1 gets a
// clear error, promptly, whatever it sends or keeps sending (an endless
// head stops at the client's bound).
func TestHostileAnswersGiveClearErrors(t *testing.T) {
	for _, tc := range []struct {
		name   string
		answer func(c net.Conn)
		want   string
		kind   errdefs.Kind
	}{
		{"not HTTP", func(c net.Conn) { io.WriteString(c, "SSH-2.0-OpenSSH_9.6\r\n") }, "malformed HTTP response", errdefs.KindUnavailable},
		{"closed at once", func(c net.Conn) {}, "the connection to sandboxd failed (did the daemon stop?): EOF", errdefs.KindUnavailable},
		{"head cut", func(c net.Conn) { io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Le") }, "malformed MIME header", errdefs.KindUnavailable},
		{"endless head", func(c net.Conn) {
			io.WriteString(c, "HTTP/1.1 200 OK\r\n")
			line := "X-Pad: " + strings.Repeat("p", 1000) + "\r\n"
			for {
				if _, err := io.WriteString(c, line); err != nil {
					return
				}
			}
		}, "headers exceeded 65536 bytes", errdefs.KindUnavailable},
		{"endless line", func(c net.Conn) {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nX-Pad: ")
			for {
				if _, err := io.WriteString(c, strings.Repeat("p", 4096)); err != nil {
					return
				}
			}
		}, "headers exceeded 65536 bytes", errdefs.KindUnavailable},
		{"error without JSON", func(c net.Conn) { io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 9\r\n\r\nupstream!") }, "sandboxd answered 502 Bad Gateway: upstream!", errdefs.KindUnavailable},
		{"redirect", func(c net.Conn) {
			io.WriteString(c, "HTTP/1.1 307 Temporary Redirect\r\nLocation: /v1/elsewhere\r\nContent-Length: 0\r\n\r\n")
		}, "sandboxd answered 307 Temporary Redirect", errdefs.KindInternal},
		{"body cut", func(c net.Conn) { io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"version\":") }, "decode the answer to GET /v1/version", errdefs.KindInternal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sock := fakeDaemon(t, func(c net.Conn, _ *http.Request) { tc.answer(c) })
			start := time.Now()
			_, err := client.New(sock).Version(ctx(t))
			if err == nil || !strings.Contains(err.Error(), tc.want) || errdefs.KindOf(err) != tc.kind {
				t.Fatalf("error %v (kind %s), want %s saying %q", err, errdefs.KindOf(err), tc.kind, tc.want)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Fatalf("took %s", d)
			}
		})
	}
}

// An answer that stops coming (the connection open, nothing more sent)
// ends with the caller's context: the reader never outwaits it.
func TestStalledAnswerEndsWithTheContext(t *testing.T) {
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	for _, partial := range []string{"", "HTTP/1.1 200 OK\r\n", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nA\r\n{\"status\":"} {
		sock := fakeDaemon(t, func(c net.Conn, _ *http.Request) {
			io.WriteString(c, partial)
			<-release
		})
		cctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		_, err := client.New(sock).Health(cctx)
		cancel()
		if !errors.Is(err, errdefs.ErrTimeout) {
			t.Fatalf("after %q: %v, want a timeout", partial, err)
		}
	}
}

// An exec whose answer is cut after the command started says the command
// may have run; one cut before it says it most likely did not.
func TestExecAnswerCutMidStream(t *testing.T) {
	for _, tc := range []struct{ frames, want string }{
		{"", "closed the connection before answering"},
		{`{"type":"queued","position":1}` + "\n", "ended before the command started"},
		{`{"type":"started"}` + "\n" + `{"type":"stdout","data":"aGk="}` + "\n", "the command may have run"},
	} {
		sock := fakeDaemon(t, func(c net.Conn, req *http.Request) {
			if req.Method != "POST" || req.URL.Path != "/v1/exec" || req.Header.Get("Content-Type") != ipc.ContentTypeNDJSON {
				io.WriteString(c, "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
				return
			}
			if tc.frames == "" {
				return
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
			io.WriteString(chunkWriter{c}, tc.frames)
		})
		var out strings.Builder
		_, err := client.New(sock).Exec(ctx(t), ipc.ExecRequest{Target: ipc.Target{Cwd: "/r"}, Argv: []string{"true"}}, client.ExecOptions{Stdout: &out})
		if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), tc.want) {
			t.Fatalf("frames %q: %v, want unavailable saying %q", tc.frames, err, tc.want)
		}
	}
}

// chunkWriter writes each Write as one chunk, and no last chunk: the body
// is cut when the connection closes.
type chunkWriter struct{ w io.Writer }

func (c chunkWriter) Write(p []byte) (int, error) {
	if _, err := io.WriteString(c.w, strconv.FormatInt(int64(len(p)), 16)+"\r\n"+string(p)+"\r\n"); err != nil {
		return 0, err
	}
	return len(p), nil
}

// sshAgent is an SSHBackend whose sandbox "SSH server" greets at once (as
// sshd does, before the client says anything) and then echoes.
type sshAgent struct{ dialed chan ipc.SSHProxyRequest }

func (a *sshAgent) SSHHosts(context.Context) (ipc.SSHHostsResponse, error) {
	return ipc.SSHHostsResponse{}, nil
}

func (a *sshAgent) DialSSH(ctx context.Context, req ipc.SSHProxyRequest) (net.Conn, error) {
	if req.Host == "nook-missing" {
		return nil, errdefs.NotFoundf("no sandbox host %s: see `nook ssh-config`", req.Host)
	}
	a.dialed <- req
	ours, theirs := net.Pipe()
	go func() {
		defer ours.Close()
		io.WriteString(ours, "SSH-2.0-sandbox\r\n")
		_, _ = io.Copy(ours, ours)
	}()
	return theirs, nil
}

// SSHProxy switches the connection to the SSH stream: the bytes the sandbox
// sent right behind the 101 (possibly read along with its head) reach the
// caller first, then the stream flows both ways.
func TestSSHProxyCarriesTheStream(t *testing.T) {
	dir, err := os.MkdirTemp("", "nook")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "s.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	agent := &sshAgent{dialed: make(chan ipc.SSHProxyRequest, 1)}
	srv := server.New(server.Backends{SSH: agent}, server.Options{Version: "ssh-1"})
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	})

	c := client.New(sock)
	_, err = c.SSHProxy(ctx(t), ipc.SSHProxyRequest{Host: "nook-missing"})
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "no sandbox host nook-missing") {
		t.Fatalf("unknown host: %v", err)
	}
	pctx, cancel := context.WithCancel(ctx(t))
	stream, err := c.SSHProxy(pctx, ipc.SSHProxyRequest{Host: "nook-repo-main"})
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	// A stream that loses bytes would leave a read waiting: fail instead.
	defer time.AfterFunc(10*time.Second, func() { stream.Close() }).Stop()
	// The request's context bounds the request, not the stream it became.
	cancel()
	if got := <-agent.dialed; got.Host != "nook-repo-main" {
		t.Fatalf("dialed %+v", got)
	}
	if c.DaemonVersion() != "ssh-1" {
		t.Fatalf("daemon version %q", c.DaemonVersion())
	}
	// Read as a proxy does, with io.Copy: the bytes that came behind the
	// answer's head (the greeting) must not be skipped.
	pr, pw := io.Pipe()
	go func() {
		_, err := io.Copy(pw, stream)
		pw.CloseWithError(err)
	}()
	br := bufio.NewReader(pr)
	if line, err := br.ReadString('\n'); err != nil || line != "SSH-2.0-sandbox\r\n" {
		t.Fatalf("greeting %q %v", line, err)
	}
	for _, msg := range []string{"ping\n", strings.Repeat("x", 100_000) + "\n"} {
		if _, err := io.WriteString(stream, msg); err != nil {
			t.Fatal(err)
		}
		if line, err := br.ReadString('\n'); err != nil || line != msg {
			t.Fatalf("echo of %d bytes: %d bytes, %v", len(msg), len(line), err)
		}
	}
}

// An exec whose stdin stays open (a terminal nobody types in) still ends
// when the daemon closes the connection before answering: it says the
// daemon went away and that the command most likely did not run.
func TestExecWithStdinOpenEndsWhenTheDaemonCloses(t *testing.T) {
	sock := fakeDaemon(t, func(c net.Conn, req *http.Request) {})
	stdin, stdinW := io.Pipe()
	defer stdinW.Close()
	done := make(chan error, 1)
	go func() {
		_, err := client.New(sock).Exec(ctx(t), ipc.ExecRequest{Target: ipc.Target{Cwd: "/r"}, Argv: []string{"true"}}, client.ExecOptions{Stdin: stdin})
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "did it die") || !strings.Contains(err.Error(), "did not run") {
			t.Fatalf("exec after the daemon closed: %v, want unavailable saying it most likely did not run", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("exec still waiting 5s after the daemon closed the connection")
	}
}

// Exec asks for binary frames and reads what the daemon answers: binary
// frames, or NDJSON from a daemon that does not know the header. A binary
// answer cut within a frame after the command started says the command
// may have run.
func TestExecReadsBinaryFramesOrNDJSON(t *testing.T) {
	binaryFrame := func(kind byte, payload string) string {
		return string(ipc.AppendFrameHead(nil, kind, len(payload))) + payload
	}
	for _, tc := range []struct {
		name, contentType, body string
		stdout, want            string
	}{
		{"ndjson", ipc.ContentTypeNDJSON, `{"type":"started"}` + "\n" + `{"type":"stdout","data":"aGk="}` + "\n" + `{"type":"exit","result":{"exitCode":4}}` + "\n", "hi", ""},
		{"binary", ipc.ContentTypeExecFrames, binaryFrame(ipc.FrameControl, `{"type":"started"}`) + binaryFrame(ipc.FrameStdout, "hi\x00") + binaryFrame(ipc.FrameControl, `{"type":"exit","result":{"exitCode":4}}`), "hi\x00", ""},
		{"binary cut", ipc.ContentTypeExecFrames, binaryFrame(ipc.FrameControl, `{"type":"started"}`) + binaryFrame(ipc.FrameStdout, "hi")[:9], "", "the command may have run"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sock := fakeDaemon(t, func(c net.Conn, req *http.Request) {
				if req.Header.Get(ipc.HeaderExecFrames) != ipc.ExecFramesBinary {
					io.WriteString(c, "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
					return
				}
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: "+tc.contentType+"\r\nTransfer-Encoding: chunked\r\n\r\n")
				io.WriteString(chunkWriter{c}, tc.body)
				if tc.want == "" {
					io.WriteString(c, "0\r\n\r\n")
				}
			})
			var out bytes.Buffer
			res, err := client.New(sock).Exec(ctx(t), ipc.ExecRequest{Target: ipc.Target{Cwd: "/r"}, Argv: []string{"true"}}, client.ExecOptions{Stdout: &out})
			if tc.want != "" {
				if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("%v, want unavailable saying %q", err, tc.want)
				}
				return
			}
			if err != nil || res.ExitCode != 4 || out.String() != tc.stdout {
				t.Fatalf("result %+v, %v, stdout %q", res, err, out.String())
			}
		})
	}
}

//go:build linux

package e2e

import (
	"archive/zip"
	"bytes"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The network tests of issue 31's dev environment: a network namespace
// and a veth pair are Linux's.

// otherNetwork is a network namespace of this machine joined to it by a
// veth pair: an address that is neither this machine's loopback nor a
// private range, where a test runs a server.
type otherNetwork struct {
	name            string
	public, private string // the namespace's addresses
}

// newOtherNetwork creates the namespace (as root), with a public-looking
// address (198.18.0.0/15, the benchmarking range) and a private one
// (10.213.0.0/16), both reachable from this machine.
func newOtherNetwork(t *testing.T) *otherNetwork {
	t.Helper()
	ip := needTool(t, "ip", "apt-get install iproute2")
	if os.Geteuid() != 0 {
		missingTool(t, "root", "run the test as root: it makes a network namespace with a veth pair")
	}
	r := rand.IntN(1 << 14)
	n := &otherNetwork{name: fmt.Sprintf("nooke2e%d", r)}
	a, b, c := 18+r>>13, (r>>5)&0xff, (r&0x1f)*4
	host := fmt.Sprintf("198.%d.%d.%d", a, b, c+1)
	n.public = fmt.Sprintf("198.%d.%d.%d", a, b, c+2)
	n.private = fmt.Sprintf("10.213.%d.%d", b, c+2)
	hostIf, nsIf := fmt.Sprintf("nookh%d", r), fmt.Sprintf("nookn%d", r)
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(ip, args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	run("netns", "add", n.name)
	t.Cleanup(func() { _ = exec.Command(ip, "netns", "del", n.name).Run() })
	run("link", "add", hostIf, "type", "veth", "peer", "name", nsIf, "netns", n.name)
	run("addr", "add", host+"/30", "dev", hostIf)
	run("link", "set", hostIf, "up")
	run("route", "add", n.private+"/32", "dev", hostIf)
	run("-n", n.name, "addr", "add", n.public+"/30", "dev", nsIf)
	run("-n", n.name, "addr", "add", n.private+"/32", "dev", nsIf)
	run("-n", n.name, "link", "set", nsIf, "up")
	run("-n", n.name, "link", "set", "lo", "up")
	run("-n", n.name, "route", "add", "default", "dev", nsIf)
	return n
}

// listen opens a TCP listener in the namespace (a socket stays in the
// namespace it was made in).
func (n *otherNetwork) listen(t *testing.T) net.Listener {
	t.Helper()
	type result struct {
		ln  net.Listener
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: err}
			return
		}
		defer orig.Close()
		target, err := os.Open("/run/netns/" + n.name)
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: err}
			return
		}
		defer target.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: err}
			return
		}
		ln, err := net.Listen("tcp4", "0.0.0.0:0")
		if unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET) == nil {
			runtime.UnlockOSThread()
		} // else the thread ends with the goroutine
		ch <- result{ln, err}
	}()
	r := <-ch
	if r.err != nil {
		t.Fatalf("listen in the network namespace %s: %v", n.name, r.err)
	}
	t.Cleanup(func() { r.ln.Close() })
	return r.ln
}

// moduleProxy serves one module, example.org/greet v1.0.0, by the GOPROXY
// protocol.
func moduleProxy(t *testing.T) http.Handler {
	t.Helper()
	var zb bytes.Buffer
	zw := zip.NewWriter(&zb)
	for name, body := range map[string]string{"go.mod": "module example.org/greet\n", "greet.go": "package greet\n\nconst Hello = \"hello from the other network\"\n"} {
		w, err := zw.Create("example.org/greet@v1.0.0/" + name)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = w.Write([]byte(body))
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{
		"/example.org/greet/@v/list":        []byte("v1.0.0\n"),
		"/example.org/greet/@v/v1.0.0.info": []byte(`{"Version":"v1.0.0","Time":"2024-01-01T00:00:00Z"}`),
		"/example.org/greet/@v/v1.0.0.mod":  []byte("module example.org/greet\n"),
		"/example.org/greet/@v/v1.0.0.zip":  zb.Bytes(),
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, ok := files[r.URL.Path]
		if !ok {
			http.NotFound(w, r)
			return
		}
		_, _ = w.Write(b)
	})
}

// TestSandboxDownloadsAModuleButDoesNotReachTheHost: by default a sandbox
// reaches the internet as a rootless container does (user-space
// networking): `go mod download` fetches a module from a server on another
// network, while this machine's loopback, its own addresses and a server
// on a private address, all of which this machine reaches, stay out of the
// sandbox's reach.
func TestSandboxDownloadsAModuleButDoesNotReachTheHost(t *testing.T) {
	t.Parallel()
	needTool(t, "pasta", "apt-get install passt")
	if _, err := os.Stat("/usr/local/go/bin/go"); err != nil {
		missingTool(t, "Go at /usr/local/go", "install Go at /usr/local/go (the sandbox's PATH has /usr/local/go/bin)")
	}
	other := newOtherNetwork(t)
	ln := other.listen(t)
	srv := &http.Server{Handler: moduleProxy(t), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })
	port := ln.Addr().(*net.TCPAddr).Port

	// This machine's own listeners, every address.
	hostLn, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer hostLn.Close()
	go func() {
		for {
			c, err := hostLn.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	hostPort := hostLn.Addr().(*net.TCPAddr).Port
	for _, addr := range []string{other.public, other.private} {
		c, err := net.DialTimeout("tcp", net.JoinHostPort(addr, fmt.Sprint(port)), 5*time.Second)
		if err != nil {
			t.Fatalf("this machine does not reach the test's server at %s: %v", addr, err)
		}
		c.Close()
	}

	e := newEnv(t)
	e.startDaemon()
	repo := e.newRepo("netdl", defaultConfig)
	e.startSandbox(repo)
	proxy := fmt.Sprintf("http://%s:%d", other.public, port)
	r := e.nook(repo, "exec", "--", "sh", "-c", "GOPROXY="+proxy+" GOSUMDB=off GOTOOLCHAIN=local go mod download -json example.org/greet@v1.0.0 && cat \"$(go env GOMODCACHE)/example.org/greet@v1.0.0/greet.go\"")
	if r.code != 0 || !strings.Contains(r.stdout, "hello from the other network") {
		t.Fatalf("go mod download from %s in the sandbox: %s", proxy, r)
	}

	// Out of reach: the test's server on its private address, this
	// machine's loopback and its own addresses (any of them, through the
	// user-space network's gateway too).
	targets := []string{net.JoinHostPort(other.private, fmt.Sprint(port)), fmt.Sprintf("127.0.0.1:%d", hostPort), fmt.Sprintf("198.51.100.1:%d", hostPort)}
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() {
			targets = append(targets, net.JoinHostPort(n.IP.String(), fmt.Sprint(hostPort)))
		}
	}
	var script strings.Builder
	for _, tg := range targets {
		h, p, _ := net.SplitHostPort(tg)
		fmt.Fprintf(&script, "timeout 5 bash -c 'exec 3<>/dev/tcp/%s/%s' 2>/dev/null && echo reached %s; ", h, p, tg)
	}
	script.WriteString("true")
	r = e.nook(repo, "exec", "--", "bash", "-c", script.String())
	if r.code != 0 || strings.Contains(r.stdout, "reached") {
		t.Fatalf("the sandbox reached this machine or a private address (%v): %s", targets, r)
	}
}

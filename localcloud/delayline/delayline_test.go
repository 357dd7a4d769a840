package delayline_test

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/localcloud/delayline"
)

// echoServer echoes every line on each connection accepted by ln.
func echoServer(t *testing.T, ln net.Listener) {
	t.Helper()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
}

func listen(t *testing.T, d time.Duration) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return delayline.Listener(ln, delayline.Fixed(d))
}

// A round trip through a delayed server takes at least 2*d.
func TestRoundTripDelayed(t *testing.T) {
	const d = 15 * time.Millisecond
	ln := listen(t, d)
	echoServer(t, ln)
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	for range 3 {
		start := time.Now()
		if _, err := c.Write([]byte("ping\n")); err != nil {
			t.Fatal(err)
		}
		line, err := r.ReadString('\n')
		if err != nil || line != "ping\n" {
			t.Fatalf("echo: %q, %v", line, err)
		}
		if rtt := time.Since(start); rtt < 2*d {
			t.Fatalf("round trip took %s, less than 2*%s", rtt, d)
		}
	}
}

// Many writes in a row are not serialized by the delay: 200 echoed lines
// sent back to back cost about one round trip, not 200.
func TestThroughputKept(t *testing.T) {
	const d = 20 * time.Millisecond
	ln := listen(t, d)
	echoServer(t, ln)
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const n = 200
	go func() {
		for range n {
			_, _ = c.Write([]byte("0123456789\n"))
		}
	}()
	start := time.Now()
	r := bufio.NewReader(c)
	for i := range n {
		if _, err := r.ReadString('\n'); err != nil {
			t.Fatalf("line %d: %v", i, err)
		}
	}
	// Serialized it would take n*2*d = 8s; a delay line takes ~2*d. The
	// bound is loose: this is a shape check, not a timing assertion.
	if took := time.Since(start); took > n*d/2 {
		t.Fatalf("%d lines took %s: the delay serializes writes", n, took)
	}
}

// net/http's server aborts its background read with a past deadline and
// closes after the response: both must work through the delay line.
func TestHTTPServer(t *testing.T) {
	ln := listen(t, 5*time.Millisecond)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "hello")
	})}
	go srv.Serve(ln)
	defer srv.Close()
	client := &http.Client{Timeout: 5 * time.Second}
	for range 5 {
		resp, err := client.Get("http://" + ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || string(b) != "hello" {
			t.Fatalf("body %q, %v", b, err)
		}
	}
	req, _ := http.NewRequest("GET", "http://"+ln.Addr().String(), nil)
	req.Close = true
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "hello" {
		t.Fatalf("body with Connection: close: %q", b)
	}
}

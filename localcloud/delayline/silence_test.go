package delayline_test

import (
	"bufio"
	"errors"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/localcloud/delayline"
)

// switchable is a silence a test can start.
type switchable struct {
	mu sync.Mutex
	s  delayline.Silence
}

func (w *switchable) get() delayline.Silence {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.s
}

func (w *switchable) start(d time.Duration, dir delayline.Direction, drop bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	now := time.Now()
	w.s = delayline.Silence{From: now, Until: now.Add(d), Dir: dir, Drop: drop}
}

func silentListener(t *testing.T) (net.Listener, *switchable) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	w := &switchable{}
	return delayline.ListenerWith(ln, delayline.Options{Silence: w.get}), w
}

func dialLine(t *testing.T, addr string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, bufio.NewReader(c)
}

// echo sends a line and returns how long its echo took, or an error when
// none came within wait.
func echo(c net.Conn, r *bufio.Reader, wait time.Duration) (time.Duration, error) {
	start := time.Now()
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return 0, err
	}
	_ = c.SetReadDeadline(start.Add(wait))
	defer c.SetReadDeadline(time.Time{})
	line, err := r.ReadString('\n')
	if err != nil {
		return 0, err
	}
	if line != "ping\n" {
		return 0, errors.New("echo garbled: " + line)
	}
	return time.Since(start), nil
}

// TestSilenceHoldsOpenConnectionsAndSparesNewOnes: during a silence an open
// connection's bytes wait and go on when it ends, while a connection made
// during it works at once.
func TestSilenceHoldsOpenConnectionsAndSparesNewOnes(t *testing.T) {
	const silence = 600 * time.Millisecond
	ln, w := silentListener(t)
	echoServer(t, ln)
	old, oldR := dialLine(t, ln.Addr().String())
	if _, err := echo(old, oldR, time.Second); err != nil {
		t.Fatal(err)
	}
	w.start(silence, delayline.Both, false)
	fresh, freshR := dialLine(t, ln.Addr().String())
	if took, err := echo(fresh, freshR, time.Second); err != nil || took > silence/2 {
		t.Fatalf("a connection made during the silence: echo after %v, %v; want at once", took, err)
	}
	took, err := echo(old, oldR, 5*time.Second)
	if err != nil {
		t.Fatalf("an open connection lost its bytes in a silence that holds them: %v", err)
	}
	if took < silence-100*time.Millisecond {
		t.Fatalf("an open connection's echo came after %v, inside a silence of %v", took, silence)
	}
	if took, err := echo(old, oldR, time.Second); err != nil || took > silence/2 {
		t.Fatalf("after the silence: echo after %v, %v; want at once", took, err)
	}
}

// TestSilenceOneWayHoldsOnlyThatDirection: a silence of the client's bytes
// (up) lets the server's through, and the other way round.
func TestSilenceOneWayHoldsOnlyThatDirection(t *testing.T) {
	for _, dir := range []delayline.Direction{delayline.Up, delayline.Down} {
		t.Run(dir.String(), func(t *testing.T) {
			const silence = 500 * time.Millisecond
			ln, w := silentListener(t)
			got := make(chan time.Time, 1)
			send := make(chan struct{})
			go func() {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				defer c.Close()
				go func() {
					b := make([]byte, 1)
					if _, err := c.Read(b); err == nil {
						got <- time.Now()
					}
				}()
				<-send
				_, _ = c.Write([]byte("x"))
				time.Sleep(2 * silence)
			}()
			c, _ := dialLine(t, ln.Addr().String())
			time.Sleep(50 * time.Millisecond) // accepted before the silence
			w.start(silence, dir, false)
			start := time.Now()
			if _, err := c.Write([]byte("y")); err != nil {
				t.Fatal(err)
			}
			close(send)
			b := make([]byte, 1)
			if _, err := c.Read(b); err != nil {
				t.Fatal(err)
			}
			down := time.Since(start)
			up := (<-got).Sub(start)
			held, passed := up, down
			if dir == delayline.Down {
				held, passed = down, up
			}
			if held < silence-100*time.Millisecond || passed > silence/2 {
				t.Fatalf("silence %s: held way after %v (want >= %v), other way after %v (want at once)", dir, held, silence, passed)
			}
		})
	}
}

// TestSilenceThatDropsKeepsOpenConnectionsDeadEvenTheirClose: after a
// silence that loses bytes, the connections open before it stay silent, a
// close by the server included, while new ones work.
func TestSilenceThatDropsKeepsOpenConnectionsDeadEvenTheirClose(t *testing.T) {
	const silence = 300 * time.Millisecond
	ln, w := silentListener(t)
	closeIt := make(chan struct{})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					select {
					case <-closeIt:
						return
					default:
					}
					_ = c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
					line, err := r.ReadString('\n')
					if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
						return
					}
					if line != "" {
						_, _ = c.Write([]byte(line))
					}
				}
			}()
		}
	}()
	old, oldR := dialLine(t, ln.Addr().String())
	if _, err := echo(old, oldR, time.Second); err != nil {
		t.Fatal(err)
	}
	w.start(silence, delayline.Both, true)
	time.Sleep(silence + 100*time.Millisecond)
	if _, err := echo(old, oldR, 500*time.Millisecond); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("an open connection after a silence that drops: %v, want no answer", err)
	}
	fresh, freshR := dialLine(t, ln.Addr().String())
	if _, err := echo(fresh, freshR, time.Second); err != nil {
		t.Fatalf("a connection made after the silence: %v", err)
	}
	close(closeIt) // the server closes both
	_ = old.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
	if _, err := oldR.ReadByte(); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the client of a dead connection saw the server's close: %v", err)
	}
	_ = fresh.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := freshR.ReadByte(); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a live connection did not see the server's close: %v", err)
	}
}

// TestSilenceOfNewConnectionsHoldsThoseMadeDuringIt: with New, a
// connection made during the silence waits for its end too, and one made
// after it works at once.
func TestSilenceOfNewConnectionsHoldsThoseMadeDuringIt(t *testing.T) {
	const silence = 500 * time.Millisecond
	ln, w := silentListener(t)
	echoServer(t, ln)
	w.mu.Lock()
	now := time.Now()
	w.s = delayline.Silence{From: now, Until: now.Add(silence), New: true}
	w.mu.Unlock()
	during, duringR := dialLine(t, ln.Addr().String())
	took, err := echo(during, duringR, 5*time.Second)
	if err != nil || took < silence-150*time.Millisecond {
		t.Fatalf("a connection made during a silence of new connections: echo after %v, %v", took, err)
	}
	after, afterR := dialLine(t, ln.Addr().String())
	if took, err := echo(after, afterR, time.Second); err != nil || took > silence/2 {
		t.Fatalf("a connection made after the silence: echo after %v, %v", took, err)
	}
}

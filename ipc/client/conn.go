package client

import (
	"net"
	"sync"
)

// watchedConn reports when its connection fails. An exec whose request
// body is still streaming (stdin, signals) needs it: when the daemon dies
// before answering, net/http's round trip waits for the request body's
// writer to finish, and that writer waits for stdin or a signal, so nothing
// would end the call. The exec closes its request stream when the
// connection it got fails.
type watchedConn struct {
	net.Conn
	once sync.Once
	dead chan struct{}
}

func watch(c net.Conn) *watchedConn { return &watchedConn{Conn: c, dead: make(chan struct{})} }

func (c *watchedConn) died() { c.once.Do(func() { close(c.dead) }) }

func (c *watchedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil {
		c.died()
	}
	return n, err
}

func (c *watchedConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if err != nil {
		c.died()
	}
	return n, err
}

func (c *watchedConn) Close() error {
	c.died()
	return c.Conn.Close()
}

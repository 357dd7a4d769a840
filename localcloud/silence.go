package localcloud

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/sandboxd/sandboxd/localcloud/delayline"
)

// maxSilence bounds an injected silence.
const maxSilence = 10 * time.Minute

// silencer holds the current silence of the server's connections (API and
// agents alike).
type silencer struct {
	mu sync.Mutex
	s  delayline.Silence
}

func (x *silencer) get() delayline.Silence {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.s
}

// Silence starts a silence of d on every open API and agent connection
// (fault injection): their bytes in dir are held until it ends or, with
// drop, lost and those connections stay silent for good. Connections made
// from now on work. A new silence replaces the current one; d of zero ends
// it.
//
// With newToo, connections made during the silence are held as well (the
// network is down rather than changed).
func (s *Server) Silence(d time.Duration, dir delayline.Direction, drop, newToo bool) (delayline.Silence, error) {
	if d < 0 || d > maxSilence {
		return delayline.Silence{}, fmt.Errorf("silence of %v is out of range 0..%v", d, maxSilence)
	}
	now := time.Now()
	sl := delayline.Silence{From: now, Until: now.Add(d), Dir: dir, Drop: drop, New: newToo}
	s.silence.mu.Lock()
	s.silence.s = sl
	s.silence.mu.Unlock()
	s.log.Info("silence injected", "duration", d, "direction", dir.String(), "drop", drop, "new_connections_too", newToo)
	return sl, nil
}

// wrapListener delays and silences what ln accepts.
func (s *Server) wrapListener(ln net.Listener) net.Listener {
	return delayline.ListenerWith(ln, delayline.Options{Delay: s.oneWayDelay, Silence: s.silence.get})
}

type connKey struct{}

// withConn remembers the connection of each API request (the one that asks
// for a silence is spared by it).
func withConn(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, connKey{}, c)
}

// exemptRequestConn takes the connection of r out of every silence.
func exemptRequestConn(r *http.Request) {
	c, _ := r.Context().Value(connKey{}).(net.Conn)
	if tc, ok := c.(*tls.Conn); ok {
		c = tc.NetConn()
	}
	if c != nil {
		delayline.Exempt(c)
	}
}

// SilenceRequest is the body of POST /admin/silence.
type SilenceRequest struct {
	// DurationMS is how long the silence lasts; 0 ends the current one.
	DurationMS int64 `json:"duration_ms"`
	// Direction is "both" (default), "up" (client to server) or "down".
	Direction string `json:"direction,omitempty"`
	// Drop loses the bytes instead of holding them: the open connections
	// stay silent for good.
	Drop bool `json:"drop,omitempty"`
	// New holds the connections made during the silence too.
	New bool `json:"new,omitempty"`
}

// SilenceAnswer says what was injected.
type SilenceAnswer struct {
	From      time.Time `json:"from"`
	Until     time.Time `json:"until"`
	Direction string    `json:"direction"`
	Drop      bool      `json:"drop"`
	New       bool      `json:"new"`
}

func (s *Server) setSilence(w http.ResponseWriter, r *http.Request, p principal) error {
	var req SilenceRequest
	if err := decode(r, &req); err != nil {
		return err
	}
	dir, err := delayline.ParseDirection(req.Direction)
	if err != nil {
		return errorf(http.StatusBadRequest, "%v", err)
	}
	exemptRequestConn(r)
	sl, err := s.Silence(time.Duration(req.DurationMS)*time.Millisecond, dir, req.Drop, req.New)
	if err != nil {
		return errorf(http.StatusBadRequest, "%v", err)
	}
	return writeJSON(w, http.StatusOK, SilenceAnswer{From: sl.From, Until: sl.Until, Direction: dir.String(), Drop: sl.Drop, New: sl.New})
}

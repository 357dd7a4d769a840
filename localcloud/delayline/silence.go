package delayline

import (
	"fmt"
	"net"
	"time"
)

// Direction says which bytes of a connection a silence holds, seen from
// the client: Up is what the client sends, Down what it receives.
type Direction int

// Directions of a silence.
const (
	Both Direction = iota
	Up
	Down
)

// ParseDirection reads "both", "up" or "down" ("" is both).
func ParseDirection(s string) (Direction, error) {
	switch s {
	case "", "both":
		return Both, nil
	case "up":
		return Up, nil
	case "down":
		return Down, nil
	}
	return Both, fmt.Errorf("silence direction %q is not one of both, up, down", s)
}

func (d Direction) String() string {
	switch d {
	case Up:
		return "up"
	case Down:
		return "down"
	}
	return "both"
}

// Silence is what a laptop's sleep or Wi-Fi change does to connections:
// from From until Until, the bytes of the connections accepted before From
// are held (none is lost; they go on at Until, as TCP does after a short
// sleep) or, with Drop, are lost and those connections stay silent for
// good, their closes included (as after a change of network). Connections
// accepted from From on are not touched, unless New: then those accepted
// before Until are held too (the network is down, not only changed). The
// zero value holds nothing.
type Silence struct {
	From, Until time.Time
	Dir         Direction
	Drop        bool
	New         bool
}

// Options of a delayed listener.
type Options struct {
	// Delay is added to every chunk each way; none when nil.
	Delay func() time.Duration
	// Silence is asked for every chunk; none when nil.
	Silence func() Silence
}

// pollSilence is how often a held chunk looks again at the silence (it can
// be ended or replaced while it lasts).
const pollSilence = 20 * time.Millisecond

// dropLinger bounds how long a connection silenced for good keeps its
// socket after the server closed it, waiting for the client to close
// first: the client must not learn of the server's close.
const dropLinger = 2 * time.Minute

// ListenerWith wraps ln so that every accepted connection is delayed and
// silenced as opts say.
func ListenerWith(ln net.Listener, opts Options) net.Listener {
	if opts.Delay == nil {
		opts.Delay = Fixed(0)
	}
	return &listener{Listener: ln, d: opts.Delay, silence: opts.Silence}
}

// Exempt takes c out of every silence (the connection that asked for the
// silence must get its answer); it reports whether c is a delayed
// connection.
func Exempt(c net.Conn) bool {
	dc, ok := c.(*conn)
	if ok {
		dc.exempt.Store(true)
	}
	return ok
}

func (s Silence) holds(dir Direction) bool { return s.Dir == Both || s.Dir == dir }

// gate blocks while the silence holds dir's bytes of c and reports whether
// they are lost instead.
func (c *conn) gate(dir Direction) (drop bool) {
	for {
		if c.dropped[dir].Load() {
			return true
		}
		if c.silence == nil || c.exempt.Load() {
			return false
		}
		s := c.silence()
		now := time.Now()
		affected := c.born.Before(s.From) || s.New && c.born.Before(s.Until)
		if s.Until.IsZero() || !s.holds(dir) || !affected || now.Before(s.From) {
			return false
		}
		if s.Drop {
			c.dropped[dir].Store(true)
			return true
		}
		if !now.Before(s.Until) {
			return false
		}
		time.Sleep(min(s.Until.Sub(now), pollSilence))
	}
}

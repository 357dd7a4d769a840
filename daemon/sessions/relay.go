package sessions

import (
	"bufio"
	"context"
	"encoding/binary"
	"io"
	"time"

	"github.com/sandboxd/sandboxd/daemon/relay"
	"github.com/sandboxd/sandboxd/daemon/sshpool"
	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// The relay (package relay): each controller has a slot; a held exec
// uses its relay when it is up and idle, else `hold start`, and a held
// synced exec's exchange runs in it once it serves (relayExchanges).

// DefaultRelayIdle is how long a relay stays open after its last exec.
const DefaultRelayIdle = relay.DefaultIdle

// relayed runs command (id) on the relay r, holding lc's lock: the
// output to stdio's writers, stdin from stdio.Stdin (hold's frames: the
// empty one is the end), signals and the caller's end as `hold signal`
// execs. The errors are relay.Run's.
func (m *Manager) relayed(ctx context.Context, r *relay.Relay, lc *sshpool.Locked, id, command string, stdio sshpool.Stdio, cutStdin func()) (sshpool.ExitStatus, error) {
	return r.Run(ctx, relay.Call{
		Req:      helperproto.RelayRequest{ID: id, Argv: []string{"sh", "-c", command}},
		Feed:     func(w io.Writer) { relayStdin(w, stdio.Stdin) },
		CutStdin: cutStdin,
		Stdout:   stdio.Stdout, Stderr: stdio.Stderr, Signals: stdio.Signals,
		Hold: id, SignalTimeout: m.signalTimeout(), Idle: m.relayIdle(),
	})
}

// relayExchanges is the exchange runner of a synced exec on lc: its
// controller's relay.
func (m *Manager) relayExchanges(c *sandbox, lc *sshpool.Locked, helper string) relay.Exchanges {
	return relay.Exchanges{Slot: c.relays, Lock: lc, Helper: helper, Idle: m.relayIdle(), SignalTimeout: m.signalTimeout()}
}

// signalTimeout bounds a `hold signal` exec.
func (m *Manager) signalTimeout() time.Duration {
	_, probeTimeout := m.waitBounds()
	return probeTimeout + helperStartSlack
}

// relayStdin copies the exec's stdin, in hold's frames, to the relay as
// its 'i' and 'z' frames, until the end frame or the reader's end.
func relayStdin(w io.Writer, src io.Reader) {
	if src == nil {
		_, _ = w.Write(helperproto.AppendHoldFrame(nil, helperproto.HoldInEnd, nil))
		return
	}
	br := bufio.NewReaderSize(src, maxStdinFrame+frameHeader)
	buf := make([]byte, maxStdinFrame)
	var hdr [frameHeader]byte
	for {
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			return
		}
		n := int(binary.BigEndian.Uint32(hdr[:]))
		if n == 0 {
			_, _ = w.Write(helperproto.AppendHoldFrame(nil, helperproto.HoldInEnd, nil))
			return
		}
		if n > maxStdinFrame {
			return
		}
		if _, err := io.ReadFull(br, buf[:n]); err != nil {
			return
		}
		if _, err := w.Write(helperproto.AppendHoldFrame(nil, helperproto.HoldIn, buf[:n])); err != nil {
			return
		}
	}
}

func (m *Manager) relayIdle() time.Duration { return m.opts.RelayIdle }

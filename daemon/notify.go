package daemon

import (
	"log/slog"
	"strings"

	sddaemon "github.com/coreos/go-systemd/v22/daemon"
)

// sdNotify sends a state to the service manager over $NOTIFY_SOCKET; it is
// a no-op when the variable is unset (not started by systemd).
func sdNotify(state string) error {
	_, err := sddaemon.SdNotify(false, state)
	return err
}

// notifier sends sd_notify states. A failure to notify is logged, never
// fatal: the daemon works the same without a service manager.
type notifier struct {
	send func(state string) error
	log  *slog.Logger
}

func (n notifier) notify(states ...string) {
	if err := n.send(strings.Join(states, "\n")); err != nil {
		n.log.Warn("sd_notify failed", "state", states, "err", err)
	}
}

// status is a STATUS= line; a newline would start another assignment.
func status(s string) string { return "STATUS=" + strings.ReplaceAll(s, "\n", " ") }

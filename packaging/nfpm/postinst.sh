#!/bin/sh
# sandboxd is a per-user daemon: installing the package starts nothing and
# enables nothing (a package script runs as root, and root's daemon would be
# of no use to anyone). Each user turns it on for themselves, or lets nook
# start it on first use.
set -e
if [ "$1" = configure ] || [ "$1" = 1 ]; then
	cat <<'MSG'
sandboxd installed. nook starts the daemon by itself on first use; to let
systemd start it on demand and at login instead, run as your user (not root):
  systemctl --user daemon-reload
  systemctl --user enable --now sandboxd.socket sandboxd.service
MSG
fi
exit 0

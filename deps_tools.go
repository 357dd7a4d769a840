//go:build tools

package sandboxd

import (
	_ "github.com/coreos/go-systemd/v22/activation"
	_ "github.com/coreos/go-systemd/v22/daemon"
	_ "github.com/fsnotify/fsnotify"
	_ "github.com/gorilla/mux"
	_ "go.etcd.io/bbolt"
	_ "golang.org/x/crypto/ssh"
	_ "golang.org/x/sys/unix"
	_ "golang.org/x/term"
	_ "gopkg.in/yaml.v3"
)

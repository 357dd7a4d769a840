//go:build tools

package sandboxd
import (
 _ "github.com/coreos/go-systemd/v22/activation"
 _ "github.com/coreos/go-systemd/v22/daemon"
 _ "go.etcd.io/bbolt"
 _ "github.com/gorilla/mux"
 _ "golang.org/x/crypto/ssh"
 _ "github.com/fsnotify/fsnotify"
 _ "gopkg.in/yaml.v3"
 _ "golang.org/x/sys/unix"
 _ "golang.org/x/term"
)

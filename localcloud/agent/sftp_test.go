package agent

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/crypto/ssh"

	"github.com/sandboxd/sandboxd/internal/testutil"
)

// sftpPacket writes one SFTP packet: length, type, payload.
func sftpPacket(w io.Writer, typ byte, payload []byte) error {
	var b bytes.Buffer
	_ = binary.Write(&b, binary.BigEndian, uint32(1+len(payload)))
	b.WriteByte(typ)
	b.Write(payload)
	_, err := w.Write(b.Bytes())
	return err
}

// readSFTPPacket reads one SFTP packet: its type and payload.
func readSFTPPacket(r io.Reader) (byte, []byte, error) {
	var n uint32
	if err := binary.Read(r, binary.BigEndian, &n); err != nil {
		return 0, nil, err
	}
	if n == 0 || n > 1<<20 {
		return 0, nil, errors.New("bad SFTP packet length")
	}
	p := make([]byte, n)
	if _, err := io.ReadFull(r, p); err != nil {
		return 0, nil, err
	}
	return p[0], p[1:], nil
}

// subsystem opens a session channel with the subsystem name; exit is the
// status the agent reports at the end (-1 when none).
func subsystem(t *testing.T, c *ssh.Client, name string) (ch ssh.Channel, ok bool, exit <-chan int) {
	t.Helper()
	ch, reqs, err := c.OpenChannel("session", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ch.Close() })
	status := make(chan int, 1)
	go func() {
		code := -1
		for r := range reqs {
			if r.Type == "exit-status" && len(r.Payload) == 4 {
				code = int(binary.BigEndian.Uint32(r.Payload))
			}
			if r.WantReply {
				_ = r.Reply(false, nil)
			}
		}
		status <- code
	}()
	ok, err = ch.SendRequest("subsystem", true, ssh.Marshal(struct{ Name string }{name}))
	if err != nil {
		t.Fatal(err)
	}
	return ch, ok, status
}

// TestSFTPSubsystem: the sftp subsystem runs OpenSSH's sftp-server as a
// command, in the workspace (its "." is the workspace); another subsystem
// is refused.
func TestSFTPSubsystem(t *testing.T) {
	found := false
	for _, p := range DefaultSFTPServers {
		if st, err := os.Stat(p); err == nil && st.Mode()&0o111 != 0 {
			found = true
		}
	}
	if !found {
		testutil.MissingTool(t, "OpenSSH's sftp-server", "apt-get install openssh-sftp-server")
	}
	f := start(t)
	c := f.dial(t)
	ch, ok, exit := subsystem(t, c, "sftp")
	if !ok {
		t.Fatal("the sftp subsystem was refused")
	}
	in, out := ch, ch
	if err := sftpPacket(in, 1, []byte{0, 0, 0, 3}); err != nil { // SSH_FXP_INIT, version 3
		t.Fatal(err)
	}
	if typ, _, err := readSFTPPacket(out); err != nil || typ != 2 { // SSH_FXP_VERSION
		t.Fatalf("no SFTP version answer: type %d, %v", typ, err)
	}
	// SSH_FXP_REALPATH "." (id 7) answers SSH_FXP_NAME with one name.
	if err := sftpPacket(in, 16, append([]byte{0, 0, 0, 7}, ssh.Marshal(struct{ P string }{"."})...)); err != nil {
		t.Fatal(err)
	}
	typ, payload, err := readSFTPPacket(out)
	if err != nil || typ != 104 || len(payload) < 8 {
		t.Fatalf("realpath: type %d, %v", typ, err)
	}
	var name struct{ Name string }
	if err := ssh.Unmarshal(payload[8:8+4+int(binary.BigEndian.Uint32(payload[8:]))], &name); err != nil {
		t.Fatal(err)
	}
	want, _ := filepath.EvalSymlinks(f.dir)
	if name.Name != want {
		t.Fatalf("sftp-server's directory is %q, want the workspace %q", name.Name, want)
	}
	_ = ch.CloseWrite()
	if code := <-exit; code != 0 {
		t.Fatalf("sftp-server did not end cleanly at the end of its input: status %d", code)
	}
	if _, ok, _ := subsystem(t, c, "netconf"); ok {
		t.Fatal("an unknown subsystem was accepted")
	}
}

// TestSFTPSubsystemWithoutServer: with no sftp-server in the sandbox the
// subsystem says what to install (and the scp -O fallback), exit 127.
func TestSFTPSubsystemWithoutServer(t *testing.T) {
	f := startWith(t, func(c *Config) { c.SFTPServers = []string{"/nonexistent/sftp-server"} })
	ch, ok, exit := subsystem(t, f.dial(t), "sftp")
	if !ok {
		t.Fatal("the sftp subsystem was refused")
	}
	stderr, _ := io.ReadAll(ch.Stderr())
	if code := <-exit; code != 127 || !strings.Contains(string(stderr), "apt-get install openssh-sftp-server") || !strings.Contains(string(stderr), "scp -O") {
		t.Fatalf("sftp without a server: status %d %q", code, stderr)
	}
}

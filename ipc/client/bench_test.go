package client_test

import (
	"context"
	"io"
	"testing"

	"github.com/sandboxd/sandboxd/ipc"
	"github.com/sandboxd/sandboxd/ipc/client"
	"github.com/sandboxd/sandboxd/ipc/server"
)

// BenchmarkExecOutput is the socket's cost for a command's output: the
// daemon's frames (base64 in JSON) to the caller's writer, per byte.
func BenchmarkExecOutput(b *testing.B) {
	s, c := start(b)
	chunk := make([]byte, 32<<10)
	for i := range chunk {
		chunk[i] = byte(i)
	}
	const total = 64 << 20
	s.Sessions.ExecFn = func(ctx context.Context, req ipc.ExecRequest, st server.ExecStream) (ipc.ExecResult, error) {
		for n := 0; n < total; n += len(chunk) {
			if _, err := st.Stdout().Write(chunk); err != nil {
				return ipc.ExecResult{}, err
			}
		}
		return ipc.ExecResult{}, nil
	}
	b.SetBytes(total)
	for b.Loop() {
		if _, err := c.Exec(context.Background(), ipc.ExecRequest{Target: ipc.Target{Cwd: "/r"}, Argv: []string{"cat"}}, client.ExecOptions{Stdout: io.Discard}); err != nil {
			b.Fatal(err)
		}
	}
}

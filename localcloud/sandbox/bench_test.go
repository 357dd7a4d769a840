//go:build linux

package sandbox

import (
	"context"
	"os"
	"testing"
)

// BenchmarkCommand measures one command started and waited for in a
// sandbox (nsenter, setpriv and the cgroup entry included) against a
// plain process.
func BenchmarkCommand(b *testing.B) {
	for _, iso := range []string{IsolationNamespaces, IsolationNone} {
		b.Run(iso, func(b *testing.B) {
			p, err := New(context.Background(), Options{Isolation: iso})
			if err != nil {
				b.Fatal(err)
			}
			ws := b.TempDir()
			sb, err := p.Start(context.Background(), Spec{ID: "bench", Workspace: ws})
			if err != nil {
				b.Fatal(err)
			}
			defer sb.Close()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := sb.Command(context.Background(), ws, "/bin/true").Run(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkDialTCP measures one connection to a port the sandbox listens
// on: by setns (root) and through the dialer (a localcloud that is not
// root), against a plain dial on this machine's loopback.
func BenchmarkDialTCP(b *testing.B) {
	ctx := context.Background()
	p, err := New(ctx, Options{})
	if err != nil {
		b.Fatal(err)
	}
	ws := b.TempDir()
	sb, err := p.Start(ctx, Spec{ID: "bench", Workspace: ws})
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	// No listener: a refused connection costs the same trip into the
	// namespace as an accepted one.
	for _, via := range []string{"setns", "dialer"} {
		b.Run(via, func(b *testing.B) {
			if via == "setns" && os.Geteuid() != 0 {
				b.Skip("setns needs root")
			}
			p.viaDialer.Store(via == "dialer")
			for i := 0; i < b.N; i++ {
				if c, err := sb.DialTCP(ctx, "127.0.0.1:1"); err == nil {
					c.Close()
				}
			}
		})
	}
}

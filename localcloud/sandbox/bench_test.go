//go:build linux

package sandbox

import (
	"context"
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

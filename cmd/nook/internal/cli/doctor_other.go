//go:build !linux

package cli

import "github.com/sandboxd/sandboxd/ipc"

// checkWatches: kqueue (macOS, BSD) has no per-user watch limit to check.
func checkWatches() ipc.DoctorCheck {
	return ipc.DoctorCheck{Name: "watches", OK: true, Detail: "kqueue: no watch limit to check"}
}

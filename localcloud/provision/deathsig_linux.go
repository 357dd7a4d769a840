package provision

import "syscall"

// dieWithServer makes the kernel SIGKILL a command when the server that
// started it dies (even by SIGKILL): a sandbox's commands must not run on
// under init with nobody left to read their results. The signal is tied to
// the forking thread; the Go runtime does not end its threads while the
// process lives, so in practice it fires when the server dies.
func dieWithServer(a *syscall.SysProcAttr) *syscall.SysProcAttr {
	a.Pdeathsig = syscall.SIGKILL
	return a
}

//go:build !linux

package provision

import "syscall"

// dieWithServer has no equivalent here: commands outlive a killed server.
func dieWithServer(a *syscall.SysProcAttr) *syscall.SysProcAttr { return a }

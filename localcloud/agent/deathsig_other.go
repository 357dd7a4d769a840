//go:build !linux

package agent

import "syscall"

// dieWithServer has no equivalent here: commands outlive a killed server.
func dieWithServer(a *syscall.SysProcAttr) *syscall.SysProcAttr { return a }

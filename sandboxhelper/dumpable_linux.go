package sandboxhelper

import "syscall"

// undumpable makes the process non-dumpable (prctl PR_SET_DUMPABLE 0):
// /proc/<pid>/fd, mem and ptrace are then closed to processes of the same
// uid, such as the user's command.
func undumpable() {
	const prSetDumpable = 4
	_, _, _ = syscall.RawSyscall(syscall.SYS_PRCTL, prSetDumpable, 0, 0)
}

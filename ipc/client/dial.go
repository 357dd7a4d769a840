package client

import (
	"context"
	"errors"
	"os"
	"syscall"
	"time"
)

// dialUnix connects to the Unix socket at path and returns the connection
// as a pollable file (reads, writes and deadlines through the runtime's
// poller). net's dialer would do the same, but linking net costs every nook
// start its package initialisation and a larger binary.
func dialUnix(ctx context.Context, path string, timeout time.Duration) (*os.File, error) {
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	syscall.CloseOnExec(fd)
	if err := syscall.SetNonblock(fd, true); err != nil {
		syscall.Close(fd)
		return nil, os.NewSyscallError("setnonblock", err)
	}
	if err := connectUnix(ctx, fd, path, timeout); err != nil {
		syscall.Close(fd)
		return nil, &os.PathError{Op: "connect", Path: path, Err: err}
	}
	return os.NewFile(uintptr(fd), path), nil
}

// connectUnix connects fd to path. A Unix socket's connect never
// completes later: EAGAIN says the daemon's backlog is full and nothing
// happened, so it is tried again, a little later each time, until ctx ends
// or timeout passes.
func connectUnix(ctx context.Context, fd int, path string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	wait := time.Millisecond
	for {
		err := syscall.Connect(fd, &syscall.SockaddrUnix{Name: path})
		if !errors.Is(err, syscall.EAGAIN) && !errors.Is(err, syscall.EINTR) {
			return err
		}
		left := time.Until(deadline)
		if left <= 0 {
			return syscall.ETIMEDOUT
		}
		t := time.NewTimer(min(wait, left))
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		wait = min(2*wait, 50*time.Millisecond)
	}
}

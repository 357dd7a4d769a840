package cli

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/sandboxd/sandboxd/ipc"
)

// Below these inotify limits, sandboxd's watches (.git/HEAD, the sandbox
// configs) compete with editors and fail; Linux's old defaults are 8192
// watches and 128 instances.
const (
	minWatches   = 8192
	minInstances = 128
)

// checkWatches reads the inotify limits.
func checkWatches() ipc.DoctorCheck {
	c := ipc.DoctorCheck{Name: "watches"}
	read := func(name string) (int, error) {
		b, err := os.ReadFile("/proc/sys/fs/inotify/" + name)
		if err != nil {
			return 0, err
		}
		return strconv.Atoi(strings.TrimSpace(string(b)))
	}
	watches, err1 := read("max_user_watches")
	instances, err2 := read("max_user_instances")
	if err1 != nil || err2 != nil {
		c.Detail = fmt.Sprintf("cannot read the inotify limits: %v %v", err1, err2)
		c.Fix = "sandboxd then checks branches and configs on each call instead of watching them"
		return c
	}
	c.Detail = fmt.Sprintf("inotify: %d watches, %d instances per user", watches, instances)
	c.OK = watches >= minWatches && instances >= minInstances
	if !c.OK {
		c.Fix = "raise them: sudo sysctl fs.inotify.max_user_watches=524288 fs.inotify.max_user_instances=512 (and put the same in /etc/sysctl.d/99-inotify.conf)"
	}
	return c
}

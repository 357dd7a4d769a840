package ipc

import "fmt"

// DriftWarning is the one wording of the config-drift warning, shared by the
// daemon (exec warnings) and sbx (status), so that users see one message.
func DriftWarning(configFile string) string {
	return fmt.Sprintf("%s changed since this sandbox started: run `sbx reset` to start a sandbox with the new config", configFile)
}

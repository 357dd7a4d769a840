//go:build race

package e2e

// raceEnabled builds the binaries under test with the race detector when the
// tests themselves run with it (make test), so races inside the daemon, the
// client and the local remote are caught end to end.
const raceEnabled = true
